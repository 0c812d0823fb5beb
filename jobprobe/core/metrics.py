# SPDX-License-Identifier: Apache-2.0
"""A frame's numbers as metrics, by the fields the probes declare (the hello frame's schema): Prometheus names and
units, per-device labels, cumulative histogram buckets. Used by the node's Prometheus endpoint and the
controller's TSDB writer alike."""
from __future__ import annotations

from typing import Any

SCALE = (("_ns", "_seconds", 1e-9), ("_us", "_seconds", 1e-6), ("_mj", "_joules", 1e-3), ("_mw", "_watts", 1e-3))
DEVICE_LISTS = {("gpu", "gpus"): ("gpu", "index"), ("nic", "nics"): ("nic", "name")}


def metric_name(probe: str, field: str, kind: str) -> tuple[str, float]:
    """(Prometheus name, factor to its unit) of a declared field."""
    name, factor = field.split("[].")[-1], 1.0       # gpus[].util_gpu_pct → util_gpu_pct (its device a label)
    if kind == "histogram" and name.endswith("_log2"):
        name = name[:-5]
    for suffix, unit, f in SCALE:
        if name.endswith(suffix):
            name, factor = name[: -len(suffix)] + unit, f
            break
    name = f"jobprobe_{probe}_{name}"
    if kind == "counter":
        name += "_total"
    return name, factor


def flatten(schema: dict[str, dict[str, dict[str, str]]], probes: dict[str, Any]):
    """A sample frame's numbers as metrics, by the declared fields: yields (name, kind, device labels, value —
    a bucket list for a histogram —, factor to base units, help). Per-device lists (GPUs, NICs) become labels;
    everything else that is not a number of a counter, gauge or histogram field is left out."""
    for p, fields in probes.items():
        decl = schema.get(p)
        if not isinstance(fields, dict) or not decl:
            continue
        for k, v in fields.items():
            d = decl.get(k)
            if d is None:
                continue
            dev = DEVICE_LISTS.get((p, k))
            if dev is not None and isinstance(v, list):
                label, key = dev
                for item in v:
                    if isinstance(item, dict) and key in item:
                        for ik, iv in item.items():
                            idecl = decl.get(f"{k}[].{ik}")
                            if idecl is not None:
                                yield from _one(p, f"{k}[].{ik}", idecl, iv, ((label, str(item[key])),))
                continue
            yield from _one(p, k, d, v, ())


def _one(p: str, k: str, d: dict[str, str], v: Any, labels: tuple):
    kind = d.get("kind")
    if kind not in ("counter", "gauge", "histogram") or isinstance(v, bool) or v is None:
        return
    name, factor = metric_name(p, k, kind)
    unit = d.get("unit", "")
    doc = f"{d['doc']} [{p}.{k}, {unit}]" if isinstance(d.get("doc"), str) and d["doc"] else \
        f"{p}.{k} ({unit}); docs/FRAMES.md"
    if kind == "histogram":
        if isinstance(v, list) and all(isinstance(x, int) for x in v):
            yield name, kind, labels, v, factor, doc
    elif isinstance(v, (int, float)):
        yield name, kind, labels, v, factor, doc


def cumulative_buckets(counts: list[int], factor: float) -> list[tuple[str, int]]:
    """log2 bucket counts (bucket i: [2^i, 2^(i+1)) of the field's unit) → Prometheus (le, cumulative) pairs."""
    out, total = [], 0
    for i, c in enumerate(counts):
        total += c
        out.append((repr(float(2 ** (i + 1)) * factor), total))
    out.append(("+Inf", total))
    return out
