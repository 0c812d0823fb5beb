# SPDX-License-Identifier: Apache-2.0
"""A frame from outside is hostile until checked: bounded decoding, then every value checked against what the
frame's kind and its probes declare.

Who calls it: the controller, for every message of the stream (a node may be compromised, a publisher forged).
What a frame that passes is, whatever bytes it came from:

- decoded within bounds of *objects*, not only bytes: a kilobyte of zlib inflates to a megabyte of msgpack, which
  decodes to a million empty maps (~70 MiB of Python objects) — refused after `MAX_OBJECTS` containers and
  elements, with every string, byte string, list and map bounded in length while it is read;
- nested at most `MAX_DEPTH` deep; map keys strings; no byte strings (the store is JSON);
- every number finite (no NaN or inf: the store's JSON and `query` refuse them) and every integer within a signed
  64-bit range (what SQLite stores and a float64 carries to Prometheus within its precision);
- the envelope plausible: `v` 1, `seq` ≥ 0, `t` a UNIX time between 2000 and 2200, `dt` 0 to a day, names 1 to
  `MAX_NAME` characters;
- a `sample`'s `probes` a map of probe name → map of fields, `status` a map of strings; a field the controller's
  own probes declare (jobprobe/core/schema.py) of the declared type (an `int` field an integer, a `list[map]` a list of
  maps, …); a field it does not know (a newer agent's) of the type the run's `hello` declared, when that hello is
  known, else of any checked value;
- a `hello`'s `schema` well formed (types and kinds from the known lists), `interval` a positive number ≤ 1 h;
- a `heartbeat`'s `interval` a positive number ≤ 1 h, `jobs` an integer ≥ 0, `stopping` (when present) a bool.

`check(obj, declared)` raises MalformedFrame with the first reason; it never raises anything else.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import msgpack

from jobprobe.core import ends, schema
from jobprobe.core.frame import KINDS, SCHEMA_VERSION, MalformedFrame
from jobprobe.core.numbers import is_int, is_number

MAX_OBJECTS = 100_000       # containers and their elements in one frame (a busy job's sample: ~1 500)
MAX_DEPTH = 12              # maps and lists within each other (a sample: 4 — probes.gpu.gpus[].field)
MAX_STR = 64 << 10          # characters in one string (a stacks frame's folded stack lines are far shorter)
MAX_LEN = 16_384            # elements in one list or map
MAX_NAME = 256              # node, job, run, probe and field names; label keys
MAX_LABELS = 64
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1
T_MIN, T_MAX = 946_684_800.0, 7_258_118_400.0     # 2000-01-01 … 2200-01-01, UNIX s
TYPES = ("int", "float", "bool", "str", "list[int]", "list[str]", "list[map]", "map", "list[float]")
FIELD_KINDS = ("counter", "gauge", "histogram", "info")


class _TooMany(Exception):
    pass


def decode(data: bytes) -> Any:
    """msgpack bytes → objects, refused (MalformedFrame) past the bounds above, before they are all built: the
    hooks count every list and map as it is finished and stop the decoder at MAX_OBJECTS."""
    count = [0]

    def counted(obj: Any) -> Any:
        count[0] += 1 + len(obj)
        if count[0] > MAX_OBJECTS:
            raise _TooMany()
        return obj
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, list_hook=counted,
                               object_hook=counted, max_str_len=MAX_STR, max_bin_len=MAX_STR,
                               max_array_len=MAX_LEN, max_map_len=MAX_LEN, max_ext_len=0)
    except _TooMany:
        raise MalformedFrame(f"more than {MAX_OBJECTS} objects") from None
    except RecursionError:
        raise MalformedFrame("nested too deep") from None
    except (ValueError, TypeError, msgpack.UnpackException) as err:   # StackError and ExtraData are ValueErrors
        raise MalformedFrame(f"not msgpack within bounds: {type(err).__name__}: {str(err)[:120]}") from None


# ---- values -----------------------------------------------------------------------------------------------
def value(v: Any, where: str, depth: int = 0) -> None:
    """Any value a frame may hold: str, finite float, int64, bool, None, and lists and string-keyed maps of them,
    at most MAX_DEPTH deep."""
    if v is None or isinstance(v, bool):
        return
    if isinstance(v, int):
        if not INT_MIN <= v <= INT_MAX:
            raise MalformedFrame(f"{where}: integer out of the 64-bit range")
        return
    if isinstance(v, float):
        if not math.isfinite(v):
            raise MalformedFrame(f"{where}: {v} is not a finite number")
        return
    if isinstance(v, str):
        return
    if depth >= MAX_DEPTH:
        raise MalformedFrame(f"{where}: nested more than {MAX_DEPTH} deep")
    if isinstance(v, list):
        for i, x in enumerate(v):
            value(x, f"{where}[{i}]", depth + 1)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise MalformedFrame(f"{where}: a map key of type {type(k).__name__} (keys are strings)")
            if len(k) > MAX_NAME:
                raise MalformedFrame(f"{where}: a map key longer than {MAX_NAME}")
            value(x, f"{where}.{k[:40]}", depth + 1)
        return
    raise MalformedFrame(f"{where}: a value of type {type(v).__name__}")


def _is_num(v: Any) -> bool:
    return is_number(v)


_TYPE_OK: dict[str, Callable[[Any], bool]] = {
    "int": is_int,
    "float": _is_num,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list[int]": lambda v: isinstance(v, list) and all(is_int(x) for x in v),
    "list[float]": lambda v: isinstance(v, list) and all(_is_num(x) for x in v),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "list[map]": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "map": lambda v: isinstance(v, dict),
}


def _name(v: Any, what: str, max_len: int = MAX_NAME) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= max_len:
        raise MalformedFrame(f"{what}: expected a string of 1 to {max_len} characters")
    return v


# ---- the controller's own declarations ------------------------------------------------------------------
def known_fields() -> dict[str, dict[str, str]]:
    """probe → field → declared type, from the probes this version has (jobprobe/core/schema.py, generated from
    their declarations). A record's field inside a declared list[map] is named `list[].field`
    (`gpus[].util_gpu_pct`), as the probes declare it."""
    return schema.FIELDS


# ---- frames -------------------------------------------------------------------------------------------------
def check(obj: Any, declared: dict | None = None) -> dict:
    """The frame, checked (see the module's docstring); `declared` is the run's hello `schema` when known."""
    try:
        return _check(obj, declared)
    except MalformedFrame:
        raise
    except Exception as err:     # a bug in a check must refuse the frame, not stop its caller
        raise MalformedFrame(f"unreadable frame: {type(err).__name__}: {str(err)[:120]}") from None


def _check(f: Any, declared: dict | None) -> dict:
    if not isinstance(f, dict):
        raise MalformedFrame(f"not a frame: a msgpack {type(f).__name__}, expected a map")
    value(f, "frame")
    if f.get("v") != SCHEMA_VERSION or isinstance(f.get("v"), bool):
        raise MalformedFrame(f"frame field 'v' is {str(f.get('v'))[:20]!r}, expected {SCHEMA_VERSION}")
    kind = f.get("kind")
    if kind not in KINDS:
        raise MalformedFrame(f"unknown frame kind {str(kind)[:40]!r}")
    _name(f.get("node"), "frame field 'node'")
    _name(f.get("job"), "frame field 'job'")
    if "run" in f:
        _name(f["run"], "frame field 'run'")
    seq, t, dt = f.get("seq"), f.get("t"), f.get("dt")
    if not is_int(seq) or seq < 0:
        raise MalformedFrame("frame field 'seq': expected an integer ≥ 0")
    if not _is_num(t) or not T_MIN <= t <= T_MAX:
        raise MalformedFrame("frame field 't': expected a UNIX time between 2000 and 2200")
    if not _is_num(dt) or not 0 <= dt <= 86400:
        raise MalformedFrame("frame field 'dt': expected seconds from 0 to a day")
    if "labels" in f:
        labels = f["labels"]
        if not isinstance(labels, dict) or len(labels) > MAX_LABELS or \
                not all(isinstance(v, str) and len(k) <= MAX_NAME for k, v in labels.items()):
            raise MalformedFrame(f"frame field 'labels': expected at most {MAX_LABELS} names → strings")
    if kind == "sample":
        _sample(f, declared)
    elif kind == "hello":
        _hello(f)
    elif kind == "event":
        _name(f.get("event"), "event frame field 'event'", 64)
    elif kind == "heartbeat":
        _heartbeat(f)
    return f


def _heartbeat(f: dict) -> None:
    interval, jobs, stopping = f.get("interval"), f.get("jobs"), f.get("stopping", False)
    if not _is_num(interval) or not 0 < interval <= 3600:
        raise MalformedFrame("heartbeat field 'interval': expected seconds, more than 0 and at most 3600")
    if not is_int(jobs) or jobs < 0:
        raise MalformedFrame("heartbeat field 'jobs': expected an integer ≥ 0")
    if not isinstance(stopping, bool):
        raise MalformedFrame("heartbeat field 'stopping': expected a bool")


def _end(end: Any) -> None:
    """A job's last frame's `end` (core/ends.py): why (a string), its cause, exit_code 0..255 or signal 1..127 and
    the OOM kills counted, where known."""
    ok = isinstance(end, dict) and isinstance(end.get("why"), str) and len(end["why"]) <= MAX_NAME and \
        set(end) <= {"why", "cause", "exit_code", "signal", "oom_kills", "scheduler"} and \
        ("cause" not in end or end["cause"] in ends.CAUSES) and \
        ("scheduler" not in end or isinstance(end["scheduler"], str) and
         len(end["scheduler"]) <= ends.MAX_SCHEDULER) and \
        all(is_int(end[k]) and lo <= end[k] <= hi
            for k, lo, hi in (("exit_code", 0, 255), ("signal", 1, 127), ("oom_kills", 0, 1 << 31)) if k in end)
    if not ok:
        raise MalformedFrame("sample field 'end': expected a map of why (text), cause (one of "
                             f"{', '.join(ends.CAUSES)}), exit_code 0..255, signal 1..127, oom_kills ≥ 0, "
                             f"scheduler (text)")


def _sample(f: dict, declared: dict | None) -> None:
    probes, status = f.get("probes"), f.get("status", {})
    if not isinstance(probes, dict):
        raise MalformedFrame("sample field 'probes': expected a map of probe → fields")
    if not isinstance(status, dict) or not all(isinstance(v, str) for v in status.values()):
        raise MalformedFrame("sample field 'status': expected a map of probe → string")
    reads = f.get("read_dt", {})
    if not isinstance(reads, dict) or not all(isinstance(k, str) and _is_num(v) and 0 <= v <= 86400
                                              for k, v in reads.items()):
        raise MalformedFrame("sample field 'read_dt': expected a map of probe → seconds from 0 to a day")
    if "end" in f:
        _end(f["end"])
    known = known_fields()
    for probe, fields in probes.items():
        if not isinstance(fields, dict):
            raise MalformedFrame(f"probes.{probe[:40]}: expected a map of fields, got {type(fields).__name__}")
        mine = known.get(probe, {})
        theirs = (declared or {}).get(probe) if isinstance(declared, dict) else None
        for k, v in fields.items():
            typ = mine.get(k)
            if typ is None and isinstance(theirs, dict) and isinstance(theirs.get(k), dict):
                typ = theirs[k].get("type")
            if v is None or typ is None or typ not in _TYPE_OK:
                continue     # absent (None), or a field nobody declared: a checked value, not used in arithmetic
            if not _TYPE_OK[typ](v):
                raise MalformedFrame(f"probes.{probe[:40]}.{k[:40]}: declared {typ}, got {type(v).__name__}")
            if typ == "list[map]":
                _records(v, mine, f"{probe[:40]}.{k[:40]}", k)


def _records(recs: list, mine: dict[str, str], where: str, name: str) -> None:
    """The fields of a list[map]'s records, as declared (`name[].field`)."""
    for i, rec in enumerate(recs):
        for k, v in rec.items():
            typ = mine.get(f"{name}[].{k}")
            if v is not None and typ in _TYPE_OK and not _TYPE_OK[typ](v):
                raise MalformedFrame(f"probes.{where}[{i}].{k[:40]}: declared {typ}, got {type(v).__name__}")


def _hello(f: dict) -> None:
    interval = f.get("interval")
    if interval is not None and (not _is_num(interval) or not 0 < interval <= 3600):
        raise MalformedFrame("hello field 'interval': expected seconds, more than 0 and at most 3600")
    schema = f.get("schema")
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise MalformedFrame("hello field 'schema': expected a map of probe → field → declaration")
    for probe, fields in schema.items():
        if not isinstance(fields, dict):
            raise MalformedFrame(f"schema.{probe[:40]}: expected a map of field → declaration")
        for k, d in fields.items():
            if not isinstance(d, dict) or d.get("type") not in TYPES or d.get("kind") not in FIELD_KINDS \
                    or not isinstance(d.get("unit", ""), str):
                raise MalformedFrame(f"schema.{probe[:40]}.{k[:40]}: expected {{type, unit, kind}} from the known "
                                     "lists")
