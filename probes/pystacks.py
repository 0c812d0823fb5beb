# SPDX-License-Identifier: Apache-2.0
"""pystacks — where the job's Python processes are: their stacks, sampled with py-spy, folded, per interval.

Off by default. For every Python process of the job — the training script, the workers a launcher (torchrun,
accelerate) starts, the DataLoader's worker processes: whatever Python runs in the job's group or process tree —
a sampling thread takes a snapshot of every thread's stack with `py-spy dump --nonblocking --json` (the process is
never stopped: a snapshot may be torn, which sampling tolerates) at a low rate, `JOBPROBE_PYSTACKS_HZ` per second
(default 1; a deep-trace window raises it). Each interval's snapshots are folded (`outer;middle;leaf` with a count)
and sent as one `stacks` frame per process (its most frequent stacks, up to TOP), while the sample frame carries
the totals and the probe's own cost. A job with no Python process says so in `note`.

Hooks: py-spy (reads the target's memory with process_vm_readv; root, or the same user with ptrace allowed).
Which processes are Python: /proc/PID/exe named python…/pypy…, or a process that maps libpython.
Cost: one short-lived py-spy process per Python process per snapshot (~10–20 ms of wall time, a few ms of CPU);
`cost_cpu_ms` is what they used (the agent's children's rusage), so `--probes +pystacks` is measured, not guessed.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import threading
import time
from collections import Counter
from typing import Any

from jobprobe.contract.probe import STACKS_KEY, Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.devices.pyproc import is_python, py_spy, role
from jobprobe.kernel.host import Host

TOP = 20
RECHECK_S = 2.0                # the job's Python processes looked for again


def fold(threads: list[dict]) -> list[str]:
    """py-spy's JSON threads → folded stacks (root first), one per thread; idle threads marked."""
    out = []
    for th in threads:
        frames = [f"{fr.get('name', '?')} ({fr.get('short_filename', '?')}:{fr.get('line', 0)})"
                  for fr in reversed(th.get("frames") or ())]
        if frames:
            out.append(";".join(frames) + ("" if th.get("active", True) else " [idle]"))
    return out


class PyStacksProbe(Probe):
    name = "pystacks"
    default = False
    needs_root = True
    summary = "the job's Python stacks, sampled with py-spy (folded, per process; off by default)"
    fields = {
        "processes": Field("int", "count", "Python processes of the job sampled in the interval", kind="gauge"),
        "samples": Field("int", "count", "thread stacks taken in the interval (a snapshot takes every thread)"),
        "failed": Field("int", "count", "snapshots py-spy could not take (a process gone, not readable)"),
        "rate_hz": Field("float", "1/s", "snapshots per second per process", kind="gauge"),
        "top": Field("list[map]", "—", f"the interval's most frequent stacks over all processes (up to 5; each "
                     f"process's up to {TOP} are in its `stacks` frame)"),
        "top[].pid": Field("int", "—", "process"),
        "top[].stack": Field("str", "—", "folded stack, root first: `func (file:line);…`; ` [idle]` when the thread "
                             "was not running Python (asleep, waiting)"),
        "top[].count": Field("int", "count", "snapshots in which the thread was there"),
        "cost_cpu_ms": Field("float", "ms", "CPU time py-spy used in the interval (the sampler's own cost)"),
        "note": Field("str", "—", "why nothing was sampled (no Python process in the job)"),
    }

    def __init__(self, host: Host | None = None):
        super().__init__(host)
        self.target: Target | None = None
        self.exe = py_spy()
        self.hz = float(os.environ.get("JOBPROBE_PYSTACKS_HZ", "1") or 1)
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.samples = self.failed = 0
        self.pids: dict[int, str] = {}
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.cpu_prev = 0.0

    def check(self, host: Host) -> str | None:
        if self.exe is None:
            return "py-spy is not installed (pip install py-spy; scripts/setup.sh does)"
        return super().check(host)

    def start(self, target: Target) -> None:
        if self.exe is None:
            raise ProbeUnavailable("py-spy is not installed")
        self.target = target
        self.stop_event.clear()
        self.cpu_prev = self._children_cpu()
        self.thread = threading.Thread(target=self._loop, name=f"pystacks-{target.job}", daemon=True)
        self.thread.start()

    @staticmethod
    def _children_cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    def _loop(self) -> None:
        found_at = -1e9
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            if t0 - found_at > RECHECK_S:
                found_at = t0
                try:
                    live = [p for p in self.target.pids() if is_python(self.host.proc, p)]
                except Exception:
                    live = []
                with self.lock:
                    self.pids = {p: self.pids.get(p) or role(self.host.proc, p) for p in live}
            for pid in list(self.pids):
                self._snapshot(pid)
            self.stop_event.wait(max(0.0, 1.0 / self.hz - (time.monotonic() - t0)))

    def _snapshot(self, pid: int) -> None:
        try:
            r = subprocess.run([self.exe, "dump", "--pid", str(pid), "--nonblocking", "--json"],
                               capture_output=True, text=True, timeout=5)
            threads = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None
        except (subprocess.TimeoutExpired, ValueError, OSError):
            threads = None
        with self.lock:
            if threads is None:
                self.failed += 1
                return
            stacks = fold(threads)
            self.samples += len(stacks)
            self.counts.update((pid, s) for s in stacks)

    def sample(self) -> dict[str, Any]:
        with self.lock:
            counts, self.counts = self.counts, Counter()
            samples, failed, self.samples, self.failed = self.samples, self.failed, 0, 0
            pids = dict(self.pids)
        cpu = self._children_cpu()
        cost, self.cpu_prev = (cpu - self.cpu_prev) * 1000, cpu
        out: dict[str, Any] = {"processes": len(pids), "samples": samples, "failed": failed, "rate_hz": self.hz,
                               "top": [{"pid": p, "stack": s, "count": c} for (p, s), c in counts.most_common(5)],
                               "cost_cpu_ms": round(cost, 3)}
        if not pids:
            out["note"] = "no Python process in the job (none runs python… or maps libpython)"
        per: dict[int, list] = {}
        for (p, s), c in counts.most_common():
            if len(per.setdefault(p, [])) < TOP:
                per[p].append({"stack": s, "count": c})
        out[STACKS_KEY] = [{"pid": p, "role": pids.get(p, "?"), "stacks": st,
                            "samples": sum(x["count"] for x in st)} for p, st in per.items()]
        return out

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.thread = None
        self.target = None
