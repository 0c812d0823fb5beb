# SPDX-License-Identifier: Apache-2.0
"""read: decode a frame file (also one whose last frame was cut short) as JSON lines, a table of the samples, or a
summary per field."""
from __future__ import annotations

import json
import sys
import time

from jobprobe.core.errors import BadInput
from jobprobe.core.frame import MalformedFrame, StreamReader
from jobprobe.core.numbers import is_number


def _table(frames: list[dict]) -> str:
    cols: dict[str, None] = {}
    rows = []
    for f in frames:
        if f["kind"] != "sample":
            continue
        row = {"seq": str(f["seq"]), "time": time.strftime("%H:%M:%S", time.localtime(f["t"])),
               "dt": f"{f['dt']:.3f}"}
        for probe, fields in f.get("probes", {}).items():
            for k, v in fields.items():
                if isinstance(v, (int, float, str)) or v is None:
                    row[f"{probe}.{k}"] = "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        cols.update(dict.fromkeys(row))
        rows.append(row)
    names = list(cols)
    width = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in names} if rows else {}
    lines = ["  ".join(c.rjust(width[c]) for c in names)]
    lines += ["  ".join(r.get(c, "").rjust(width[c]) for c in names) for r in rows]
    return "\n".join(lines)


def _summary(frames: list[dict]) -> str:
    """Per numeric field over the sample frames: n, mean, median, max, sum. The first and last samples cover
    partial intervals (start-up, the job's end), so rates are better judged from the median."""
    series: dict[str, list[float]] = {}
    for f in frames:
        if f["kind"] == "sample":
            for probe, fields in f.get("probes", {}).items():
                for k, v in fields.items():
                    if is_number(v):
                        series.setdefault(f"{probe}.{k}", []).append(v)
    lines = [f"{'field':<34} {'n':>5} {'mean':>14} {'p50':>14} {'max':>14} {'sum':>16}"]
    for k, xs in series.items():
        ys = sorted(xs)
        lines.append(f"{k:<34} {len(xs):>5} {sum(xs) / len(xs):>14.6g} {ys[len(ys) // 2]:>14.6g} {ys[-1]:>14.6g} "
                     f"{sum(xs):>16.6g}")
    return "\n".join(lines)


def cmd_read(args) -> int:
    try:
        fp = open(args.file, "rb")
    except OSError as err:
        raise BadInput(f"cannot open {args.file}: {err.strerror}") from err
    reader = StreamReader(fp)
    frames: list[dict] = []
    err: MalformedFrame | None = None
    with fp:
        try:
            for frame in reader:
                if args.format == "jsonl":
                    print(json.dumps(frame, separators=(",", ":"), default=str))
                else:
                    frames.append(frame)
        except MalformedFrame as e:
            err = e
    if args.format == "table":
        print(_table(frames))
    elif args.format == "summary":
        print(_summary(frames))
    sys.stdout.flush()
    if reader.truncated:
        off, left = reader.truncated
        print(f"jobprobe: warning: {args.file}: last frame cut short at byte {off} ({left} bytes dropped); "
              f"{reader.count} frames read", file=sys.stderr)
    if err is not None:
        raise BadInput(f"{args.file}: {err}; {reader.count} frames read before it")
    return 0

