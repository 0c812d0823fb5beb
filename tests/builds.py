# SPDX-License-Identifier: Apache-2.0
"""What the install and image tests share: the checkout's distributions built once per test run (make), what a
node's environment may hold (AGENT_DISTS) and what one holds (dists)."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what a node's environment may hold: the agent's install_requires and theirs (nkeys → pynacl → cffi → pycparser),
# besides the venv's own pip and setuptools (kept on a node for upgrades; the image has neither)
AGENT_DISTS = {"jobprobe", "msgpack", "nvidia-ml-py", "prometheus-client", "nkeys", "pynacl", "cffi", "pycparser"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def make(target: str, out: Path, factory: pytest.TempPathFactory) -> None:
    """What `make TARGET DIST=OUT` in the checkout makes (`dist`: the sdist and the wheel; `wheels`: those and
    wheels/), built once per test run: `make wheels` (which makes `dist` first) into a directory every worker of the
    run shares, then copied to OUT. One build at a time: each writes the checkout's egg-info, and the first one makes
    .build-venv — two test files building at once on two workers would race. (Built once, not per file: 5 s of CPU.)"""
    base = factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "dist-built"
    with open(REPO / ".build-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "built").exists():
            shutil.rmtree(shared, ignore_errors=True)
            subprocess.run(["make", "-s", "-C", str(REPO), "wheels", f"DIST={shared}"], check=True, timeout=600,
                           capture_output=True)
            (shared / "built").touch()
    out.mkdir(parents=True, exist_ok=True)
    for built in shared.glob("jobprobe-*"):
        shutil.copy2(built, out)
    if target == "wheels":
        shutil.copytree(shared / "wheels", out / "wheels")


def dists(python: list[str]) -> set[str]:
    """The distributions the environment of PYTHON (an argv: a venv's python, or one run in a chroot) holds."""
    out = subprocess.run([*python, "-c", "import importlib.metadata as m, json; "
                          "print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return {norm(n) for n in json.loads(out)}
