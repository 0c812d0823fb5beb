# SPDX-License-Identifier: Apache-2.0
"""Python processes, as /proc shows them: which processes are Python, what each one runs, and the py-spy that
reads them (the pystacks probe and the deep-trace windows share these)."""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from jobprobe.kernel import procfs

PYTHON_EXE = re.compile(r"^(python|pypy)[0-9.]*[a-z]?$")


def py_spy() -> str | None:
    """The py-spy next to this interpreter (the venv's), else on PATH."""
    near = Path(sys.executable).with_name("py-spy")
    return str(near) if near.exists() else shutil.which("py-spy")


def is_python(proc: str, pid: int) -> bool:
    """/proc/PID/exe named python…/pypy…, or a process that maps libpython (an embedding program)."""
    try:
        if PYTHON_EXE.match(os.path.basename(os.readlink(f"{proc}/{pid}/exe"))):
            return True
        return b"libpython" in (procfs.read_maps(proc, pid) or b"")
    except OSError:
        return False


def role(proc: str, pid: int) -> str:
    """What the process is, in a few words: its script or module and the first argument or two."""
    cmdline = procfs.read_cmdline(proc, pid, limit=1 << 20)
    if cmdline is None:
        return "?"
    argv = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    args = argv[1:] if argv and PYTHON_EXE.match(os.path.basename(argv[0])) else argv
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(args[:3]))[:120] or "python"
