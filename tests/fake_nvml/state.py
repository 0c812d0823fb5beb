# SPDX-License-Identifier: Apache-2.0
"""The fake NVML's side of the tests: build tests/fake_nvml/fake_nvml.c into libnvidia-ml.so.1, write its ground
truth (the state file named by $FAKE_NVML_STATE, replaced atomically), count its calls ($FAKE_NVML_LOG)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SONAME = "libnvidia-ml.so.1"


def build(outdir: Path) -> Path:
    """Compile the fake as <outdir>/libnvidia-ml.so.1, soname included: the dynamic linker then matches pynvml's
    CDLL("libnvidia-ml.so.1") to it, on LD_LIBRARY_PATH or already loaded by path."""
    lib = Path(outdir) / SONAME
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", f"-Wl,-soname,{SONAME}",
                    "-o", str(lib), str(HERE / "fake_nvml.c")], check=True, capture_output=True, text=True)
    return lib


class FakeState:
    def __init__(self, path: Path, log: Path | None = None):
        self.path, self.log = Path(path), log
        self.count = 0
        self.driver = "550.54.15"
        self.gpus: dict[int, dict[str, str]] = {}

    def gpu(self, index: int, **values) -> "FakeState":
        self.gpus.setdefault(index, {}).update({k: str(v) for k, v in values.items()})
        self.count = max(self.count, index + 1)
        return self

    def mig(self, index: int, slot: int, uuid: str, gi: int, ci: int, total: int, used: int,
            procs: str = "", gpm: str = "") -> "FakeState":
        """GPU `index` in MIG mode with a MIG device in `slot`; procs "PID:BYTES …" run on it; gpm "ID=VALUE …"
        are its GPU instance's GPM metrics."""
        self.gpu(index, mig_mode=1, **{f"mig {slot}": f"{uuid} {gi} {ci} {total} {used}"})
        if procs:
            self.gpu(index, **{f"mig_procs {slot}": procs})
        if gpm:
            self.gpu(index, **{f"mig_gpm {slot}": gpm})
        return self

    def write(self) -> "FakeState":
        lines = [f"driver {self.driver}", f"count {self.count}"]
        lines += [f"{i} {k} {v}" for i, kv in sorted(self.gpus.items()) for k, v in kv.items()]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.path)   # the fake re-reads at every call: never let it see half a file
        return self

    @classmethod
    def load(cls, path: Path) -> "FakeState":
        st = cls(path)
        for line in Path(path).read_text().splitlines():
            head, _, rest = line.partition(" ")
            if head == "count":
                st.count = int(rest)
            elif head == "driver":
                st.driver = rest
            elif head.isdigit():
                key, _, value = rest.partition(" ")
                st.gpus.setdefault(int(head), {})[key] = value
        return st

    def calls(self, fn: str, index: int | None = None) -> int:
        """How often the fake saw `fn` (for GPU `index`, or any)."""
        if self.log is None or not self.log.exists():
            return 0
        rows = [ln.split() for ln in self.log.read_text().splitlines()]
        return sum(1 for f, i in rows if f == fn and (index is None or int(i) == index))
