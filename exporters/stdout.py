# SPDX-License-Identifier: Apache-2.0
"""--stdout: one compact human line per tick; --stdout json: one JSON object per frame per line.

The human line knows nothing of probes: it formats each scalar field by the unit its name ends with
(_ns, _us, _bytes), leaves histograms and lists out, and says only what is not zero — a probe that saw nothing this
tick is left out of the line (the hello line lists every probe and its status; --stdout json has every field).
"""
from __future__ import annotations

import json
import sys
import time
from typing import IO


def human_value(key: str, v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if not isinstance(v, int):
        return str(v)
    if key.endswith("_ns"):
        for unit, size, digits in (("s", 1e9, 2), ("ms", 1e6, 1), ("us", 1e3, 0)):
            if v >= size:
                return f"{v / size:.{digits}f}{unit}"
        return f"{v}ns"
    if key.endswith("_bytes"):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if v >= size:
                return f"{v / size:.1f}{unit}"
        return f"{v}B"
    if key.endswith("_us"):
        return f"{v}us"
    return str(v)


def human_line(frame: dict) -> str:
    if frame["kind"] == "hello":
        probes = " ".join(f"{k}={'ok' if v == 'ok' else 'off'}" for k, v in frame.get("probes", {}).items())
        return f"jobprobe {frame.get('version')} on {frame['node']} job {frame['job']}: {probes}"
    if frame["kind"] != "sample":
        return f"{frame['kind']} {frame.get('event', '')} job {frame['job']}"
    stamp = time.strftime("%H:%M:%S", time.localtime(frame["t"]))
    parts = [f"{stamp} {frame['job']} #{frame['seq']}"]
    for name, fields in frame.get("probes", {}).items():
        vals = [f"{k}={human_value(k, v)}" for k, v in fields.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v]
        if vals:
            parts.append(f"{name}[{' '.join(vals)}]")
    bad = [f"{k}:{v}" for k, v in frame.get("status", {}).items() if v.startswith("failed")]
    if bad:
        parts.append("FAILED " + ", ".join(bad))
    return " ".join(parts)


class StdoutSink:
    def __init__(self, fmt: str = "human", stream: IO[str] | None = None):
        if fmt not in ("human", "json"):
            raise ValueError(f"unknown stdout format {fmt!r} (human or json)")
        self.fmt = fmt
        self.stream = stream or sys.stdout

    def write(self, frame: dict, data: bytes) -> None:
        if self.fmt == "json":
            line = json.dumps(frame, separators=(",", ":"), default=str)
        else:
            line = human_line(frame)
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def __repr__(self) -> str:
        return f"StdoutSink({self.fmt})"
