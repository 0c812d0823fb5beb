#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where a command's CPU went, by process: every thread that exits while COMMAND runs, its CPU time from the kernel's
taskstats exit record (jobprobe/kernel/taskstats.py), summed per process and grouped by the process's command line
(read from /proc every 0.1 s while it lives; a process gone sooner is grouped by its thread's name). Processes still
running when COMMAND ends are not counted. Root (taskstats).

    .venv/bin/python scripts/exit_cpu.py [--top 30] -- COMMAND…
    e.g. -- .venv/bin/python -m pytest -q -m "not serial" -n 4 --no-loadscope-reorder     # phase 1 of the suite
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobprobe.kernel import taskstats  # noqa: E402


def group(cmdline: str) -> str:
    """A command line as a group: paths to temporary files and interpreters folded, the first words kept."""
    c = re.sub(r"/tmp/\S+", "TMP", cmdline)
    c = re.sub(r"\S*/python3?(\.\d+)?\b", "python", c)
    words = c.split()
    if "jobprobe.cli" in words:
        i = words.index("jobprobe.cli")
        return "jobprobe " + " ".join(words[i + 1:i + 2])
    return " ".join(words[:3])[:70]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not argv:
        ap.error("no COMMAND after --")
    parse = taskstats.parse_stats
    taskstats.parse_stats = lambda raw: (parse(raw), taskstats.field(raw, "ac_comm").split(b"\0")[0]
                                         .decode(errors="replace"))
    feed = taskstats.ExitListener()
    cmd: dict[int, str] = {}
    cpu: collections.Counter = collections.Counter()
    n: collections.Counter = collections.Counter()
    pending: collections.Counter = collections.Counter()      # tgid → CPU of its exited threads, leader not yet gone
    start = time.monotonic()
    proc = subprocess.Popen(argv)
    while True:
        done = proc.poll() is not None
        for r, comm in feed.drain():
            tgid = r.tgid or r.tid
            pending[tgid] += sum(r.cpu_ns()) / 1e9
            if r.tid == tgid:               # the leader's exit: the process is whole (its pid may be used again)
                key = group(cmd.pop(tgid, comm))
                cpu[key] += pending.pop(tgid)
                n[key] += 1
        if done:
            break
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) not in cmd:
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        text = f.read(300).replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                if text:
                    cmd[int(d)] = text
        time.sleep(0.1)
    total = sum(cpu.values())
    print(f"exit_cpu: {total:.0f} CPU s in processes that ended, over {time.monotonic() - start:.0f} s; "
          f"COMMAND exited {proc.returncode}")
    for key, v in cpu.most_common(a.top):
        print(f"{v:8.1f} s {n[key]:6d}  {key}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
