# SPDX-License-Identifier: Apache-2.0
"""Find every probe in the probes/ package by its `name`, and turn --probes specs into a list of names.

A new probe is one new module in probes/: nothing here needs editing.
"""
from __future__ import annotations

import importlib
import pkgutil

import jobprobe.probes as probes_pkg
from jobprobe.contract.probe import Probe
from jobprobe.core.errors import BadInput


def all_probes() -> dict[str, type[Probe]]:
    found: dict[str, type[Probe]] = {}
    for info in pkgutil.iter_modules(probes_pkg.__path__):
        mod = importlib.import_module(f"jobprobe.probes.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Probe) and obj is not Probe and obj.name \
                    and obj.__module__ == mod.__name__:
                found[obj.name] = obj
    return dict(sorted(found.items()))


def standard(registry: dict[str, type[Probe]]) -> list[str]:
    return [n for n, cls in registry.items() if cls.default]


def parse_probes(spec: str | None, registry: dict[str, type[Probe]]) -> list[str]:
    """'sched,perf' → exactly these; '+pystacks,-sched' → the standard set plus/minus; 'all'; None → standard.

    A spec mixes forms only as: absolute names first, then +/- edits of them ('cgroup,perf,-perf' is allowed)."""
    if spec is None or spec.strip() in ("", "std", "standard"):
        return standard(registry)
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        return standard(registry)
    unknown = [s.lstrip("+-") for s in items if s.lstrip("+-") not in registry and s.lstrip("+-") != "all"]
    if unknown:
        raise BadInput(f"unknown probe {unknown[0]!r}; valid probes: {', '.join(registry)}")
    absolute = [s for s in items if s[0] not in "+-"]
    if absolute and any(s[0] not in "+-" for s in items[len(absolute):]):
        raise BadInput(f"bad --probes {spec!r}: put names first, then +name/-name edits")
    chosen: list[str]
    if "all" in absolute:
        chosen = list(registry)
    elif absolute:
        chosen = list(dict.fromkeys(absolute))
    else:
        chosen = standard(registry)
    for s in items[len(absolute):]:
        name = s[1:]
        if s[0] == "+" and name not in chosen:
            chosen.append(name)
        elif s[0] == "-" and name in chosen:
            chosen.remove(name)
    return chosen
