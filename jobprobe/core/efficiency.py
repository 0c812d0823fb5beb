# SPDX-License-Identifier: Apache-2.0
"""Efficiency notes, as a job's summary gives them: what its node granted it (its group's CPU limit or cpuset, its
memory limit, its GPUs) against what it used, with the thresholds of the rules file's `[efficiency]` table.

    [efficiency]
    cpu_used_min = 0.5        # a note when the job used less than half the CPUs it was granted (mean after startup)
    memory_used_min = 0.25    # … less than a quarter of its memory limit at its peak
    gpu_used_min = 0.5        # … its GPUs busy less than half the time (mean after startup)

Each value is a share in (0, 1]; a key left out keeps its default. The node's rules loader accepts the table and
the summary (`jobprobe summary --rules FILE`) reads it: a bad table is one clear line (BadInput), as a bad rule is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from jobprobe.core import tomlfile
from jobprobe.core.errors import BadInput
from jobprobe.core.numbers import is_number

DEFAULTS = {"cpu_used_min": 0.5, "memory_used_min": 0.25, "gpu_used_min": 0.5}
DEFAULT_RULES = Path(__file__).resolve().parent.parent / "node" / "default_rules.toml"   # read, never imported


def thresholds(table: Any, where: str) -> dict[str, float]:
    """The `[efficiency]` table checked: DEFAULTS with its values over them."""
    if table is None:
        return dict(DEFAULTS)
    if not isinstance(table, dict):
        raise BadInput(f"{where}: [efficiency] must be a table of {', '.join(DEFAULTS)}")
    out = dict(DEFAULTS)
    for key, value in table.items():
        if key not in DEFAULTS:
            raise BadInput(f"{where}: [efficiency]: unknown key {key!r} (known: {', '.join(DEFAULTS)})")
        if not is_number(value) or not 0 < value <= 1:
            raise BadInput(f"{where}: [efficiency] {key} = {value!r}: expected a share in (0, 1]")
        out[key] = float(value)
    return out


def load(spec: str | None) -> dict[str, float]:
    """The thresholds of a rules file ("default": the shipped one; None: DEFAULTS)."""
    if spec is None:
        return dict(DEFAULTS)
    path = DEFAULT_RULES if spec == "default" else Path(spec)
    _, data = tomlfile.read(path, "rules")
    return thresholds(data.get("efficiency"), f"rules {path}")


def _gib(b: float) -> str:
    return f"{b / 2 ** 30:.1f} GiB"


def notes(used: dict[str, float], granted: dict[str, float], th: dict[str, float]) -> list[str]:
    """One line per resource the job was granted and used less of than its threshold. `used`: cpu_cores (mean),
    mem_peak_bytes, gpus_busy (mean); `granted`: cpu_cores (a limit or the cpuset's CPUs), mem_limit_bytes, gpus."""
    out = []
    cpu, cpus = used.get("cpu_cores"), granted.get("cpu_cores")
    if cpu is not None and cpus and cpu < th["cpu_used_min"] * cpus:
        out.append(f"CPU: granted {cpus:g} cores, used {cpu:.2f} on average ({100 * cpu / cpus:.0f}%): ask for "
                   f"fewer, or give the job more to do (threads, loader workers)")
    peak, limit = used.get("mem_peak_bytes"), granted.get("mem_limit_bytes")
    if peak is not None and limit and peak < th["memory_used_min"] * limit:
        out.append(f"memory: granted {_gib(limit)}, used {_gib(peak)} at its peak ({100 * peak / limit:.0f}%): "
                   f"ask for less")
    busy, gpus = used.get("gpus_busy"), granted.get("gpus")
    if busy is not None and gpus and busy < th["gpu_used_min"] * gpus:
        out.append(f"GPU: {gpus:g} GPUs, {busy:.2f} busy on average ({100 * busy / gpus:.0f}%): the GPUs wait — "
                   f"see the buckets above for on what")
    return out
