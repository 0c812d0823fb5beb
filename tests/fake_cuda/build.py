# SPDX-License-Identifier: Apache-2.0
"""Build the TEST FAKES of this folder (fake libcuda.so.1, libcudart.so.12, libnccl.so.2 and the cudaprog workload)
with gcc into a directory; put that directory first on LD_LIBRARY_PATH to run cudaprog against them.

Variants (the first instruction of each function decides how the kernel runs a uprobe there):
  "push"   -O0 -fno-omit-frame-pointer -fcf-protection=none: every function starts with push %rbp, which x86
           uprobes emulate (no single-step)
  "endbr"  -O0 -fcf-protection=full: every function starts with endbr64, which must be single-stepped
  "o2"     -O2 -fcf-protection=none: leaf functions start with whatever the optimizer put first
  "shifted" like "push", linked with its text at a virtual address far from its file offset, so that a symbol's
           value and its file offset differ (what an ELF reader must translate)
"""
from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBS = {"libcuda.so.1": "fake_cuda.c", "libcudart.so.12": "fake_cudart.c", "libnccl.so.2": "fake_nccl.c"}
VARIANTS = {
    "push": ["-O0", "-fno-omit-frame-pointer", "-fcf-protection=none"],
    "endbr": ["-O0", "-fno-omit-frame-pointer", "-fcf-protection=full"],
    "o2": ["-O2", "-fcf-protection=none"],
    "shifted": ["-O0", "-fno-omit-frame-pointer", "-fcf-protection=none", "-Wl,-Ttext-segment=0x10000000"],
}


def gcc(args: list[str]) -> None:
    res = subprocess.run(["gcc", "-Wall", "-Wextra", "-Werror", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"gcc {' '.join(args)}:\n{res.stderr}")


def build(dest: Path, variant: str = "push") -> Path:
    """Compile the three fake libraries and cudaprog into dest; returns dest."""
    dest.mkdir(parents=True, exist_ok=True)
    flags = VARIANTS[variant]
    for soname, src in LIBS.items():
        gcc([*flags, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(dest / soname), str(HERE / src), "-ldl"])
    gcc(["-O1", "-o", str(dest / "cudaprog"), str(HERE / "cudaprog.c"), "-ldl", "-lpthread"])
    return dest
