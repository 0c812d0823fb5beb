# SPDX-License-Identifier: Apache-2.0
"""eBPF C sources, one per probe (same basename as its module in probes/), shipped as package data."""
from pathlib import Path

DIR = Path(__file__).resolve().parent


def source(name: str) -> str:
    """The text of bpf/<name>.c with common.h inlined (bcc compiles from a string)."""
    common = (DIR / "common.h").read_text()
    return (DIR / f"{name}.c").read_text().replace('#include "common.h"', common)
