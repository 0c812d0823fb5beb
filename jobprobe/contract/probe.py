# SPDX-License-Identifier: Apache-2.0
"""The probe contract (DESIGN.md). Each probe is one module in probes/, found by the registry by its `name`."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

from jobprobe.contract.target import Target
from jobprobe.kernel.host import Host

if TYPE_CHECKING:
    from jobprobe.kernel.membership import Node


# sample() may return, under this key, a list of one-off events: {"event": name, "t": UNIX time (optional), ...}.
# The sampler sends each as an `event` frame right after the tick's sample frame (docs/FRAMES.md).
EVENTS_KEY = "_events"
STACKS_KEY = "_stacks"     # folded stacks a probe hands over: sent as `stacks` frames (pystacks)


# What a field's value is, for a reader that aggregates frames (docs/FRAMES.md, "Kinds of field"):
#   counter   what happened within the interval (a delta): sum it over frames, divide by dt for a rate
#   gauge     a value at t (or the device's own average over its last period, a ratio, a percentile): never sum it
#   histogram a log2 bucket list of the periods that ended in the interval: add bucket by bucket
#   info      a label, id, flag or structure: compare or group by it, never do arithmetic on it
FIELD_KINDS = ("counter", "gauge", "histogram", "info")

# The inferred kind (infer_kind); a field it gets wrong says its kind= in its declaration.
_INFO_TYPES = {"str", "bool", "list[str]", "map", "list[map]"}   # labels, flags; a list[map]'s records have
                                                                  # their keys declared as `name[].key`
_INFO_UNITS = {"—", "", "bitmask"}                                # a number without a unit is an id; bits are a set
_GAUGE_UNITS = {"%", "ratio", "cores", "1/s", "bytes/s", "MHz", "mW", "°C"}  # ratios, rates, states: never deltas
_GAUGE_NAME = re.compile(r"_p\d+_[a-z]+$"          # a percentile of the interval's histogram (runq_lat_p99_us)
                         r"|(^|_)(mem|rss)(_\w+)?_bytes$"   # memory held now, or its peak (mem_peak_bytes)
                         r"|(^|_)n?procs$")          # processes present now (nprocs, job_procs)


def infer_kind(name: str, field: "Field") -> str:
    """The kind a field declared as `name` most likely has, from its type, unit and name (the last part of a
    nested name, `gpus[].temp_c` → `temp_c`): a log2 list is a histogram; a string, flag, list of strings, map,
    list of maps, id (no unit) or bitmask is info; a ratio, rate, clock, power, temperature, percentile, memory
    size or process count is a gauge; any other number is a counter (a per-interval delta)."""
    leaf = name.rsplit(".", 1)[-1]
    if field.type == "list[int]" and leaf.endswith("_log2"):
        return "histogram"
    if field.type in _INFO_TYPES or field.unit in _INFO_UNITS:
        return "info"
    if field.unit in _GAUGE_UNITS or _GAUGE_NAME.search(leaf):
        return "gauge"
    return "counter"


class Field(NamedTuple):
    """One field a probe emits: msgpack type, unit, meaning, kind. docs/FRAMES.md lists every one of them.

    `kind` left out is inferred from the declaration (infer_kind) when the probe class is made; say it where the
    inference would be wrong (a running total, a count of things present now)."""

    type: str     # int | float | bool | str | list[int] | list[str] | list[map] | map
    unit: str     # ns, bytes, count, ratio, us, ...
    meaning: str
    kind: str = ""  # counter | gauge | histogram | info (FIELD_KINDS); "" → infer_kind


def resolve_kinds(fields: dict[str, Field]) -> dict[str, Field]:
    """`fields` with every kind filled in (declared, else inferred). A kind not in FIELD_KINDS is a declaration
    bug: TypeError, when the probe's class is made."""
    out = {k: f if f.kind else f._replace(kind=infer_kind(k, f)) for k, f in fields.items()}
    bad = [f"{k}: {f.kind!r}" for k, f in out.items() if f.kind not in FIELD_KINDS]
    if bad:
        raise TypeError(f"field kind not one of {', '.join(FIELD_KINDS)}: {', '.join(bad)}")
    return out


def schema_of(probes: Iterable[Any], docs: bool = False) -> dict[str, dict[str, dict[str, str]]]:
    """{probe: {field: {type, unit, kind}}} of probes (instances or classes), for the hello frame; with docs, each
    field's meaning too (`doc`: the node's /metrics HELP lines)."""
    return {p.name: {k: {"type": f.type, "unit": f.unit, "kind": f.kind, **({"doc": f.meaning} if docs else {})}
                     for k, f in p.fields.items()} for p in probes}


class Probe:
    name = ""                     # --probes NAME, and the key in frame["probes"]
    default = True                # part of standard collection?
    needs_root = False            # does start() need root (BPF, cgroup perf counters)?
    summary = ""                  # one line for `jobprobe probes`
    fields: dict[str, Field] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        """Every declared field gets its kind here, once: the declared one, else the inferred one."""
        super().__init_subclass__(**kw)
        resolved = resolve_kinds(cls.fields)
        if resolved != cls.fields:
            cls.fields = resolved

    def __init__(self, host: Host | None = None):
        self.host = host or Host()

    @classmethod
    def build(cls, host: Host, node: Node | None = None, sinks: Callable[[], dict] | None = None) -> Probe:
        """This probe's instance for one job of the agent, given what the agent has for it: `node`, the node's
        membership maps and shared program loads (jobprobe/kernel/membership.py); `sinks`, a callable returning the
        job's sinks' counters. The default passes neither; a probe that uses one overrides this and passes it by
        name — BpfProbe `node` (every job's eBPF probe then shares one load of its programs), the self probe
        `sinks`. Nothing is read from the constructor's signature: what a probe gets is what its build() says."""
        return cls(host)

    def check(self, host: Host) -> str | None:
        """Why this probe cannot run on this host, or None. No side effects."""
        if self.needs_root and not host.is_root:
            return "needs root"
        return None

    def start(self, target: Target) -> None:
        """Acquire everything; on failure release what was acquired and raise ProbeUnavailable."""

    def sample(self) -> dict[str, Any]:
        """This interval's values only: deltas since the previous sample (or since start). One-off events go in
        a list under EVENTS_KEY."""
        return {}

    def stop(self) -> None:
        """Release everything. Idempotent."""

    def note(self) -> str | None:
        """A running probe's word on what it is waiting for, when it is running but has nothing to count yet
        (status "ok: <note>"); None when it is counting (status "ok"). Asked after start and after each sample."""
        return None
