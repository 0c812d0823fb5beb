# SPDX-License-Identifier: Apache-2.0
"""bench stragglers: the straggler detector against a fault matrix on a real three-rank DDP job (jobprobe/bench/ddp.py:
three namespace nodes, three agents, NATS, one controller), each fault injected at a random time on a random rank,
N times per fault. Per fault: detected (the right node, the right kind), time from the fault to the name (p50/p90),
the right cause, false names; overall precision and recall.

A trial: a random 8-20 s of the job in step, the fault, up to `timeout` s for the controller's store to hold an
event (seen by polling it: the time a person reading the store would see), the fault cleared, up to `timeout` s for
the event's end, then 10 s in step again. Every `straggler` or `imbalance` event that names another node, or the
wrong kind, is a false name; a balanced trial is the job left alone for as long, where any event is false.
"""
from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from jobprobe.bench.ddp import PROBES, Cluster, DdpJob, until

KINDS = ("straggler", "imbalance")


@dataclass(frozen=True)
class Fault:
    what: str
    inject: Callable[[DdpJob, int], None]
    clear: Callable[[DdpJob, int], None]
    kind: str | None                   # the event it must raise ("straggler", "imbalance"; None: no event)
    causes: frozenset = frozenset()    # a straggler's right causes (any one)


FAULTS = {
    "cpu": Fault("CPU limit (cpu.max 0.25 cores)", lambda j, r: j.throttle(r, 0.25), lambda j, r: j.throttle(r, None),
                 "straggler", frozenset({"cpu_throttled", "runq"})),
    "neighbour": Fault("noisy neighbour (pinned beside a CPU hog)", lambda j, r: j.neighbour(r, True),
                       lambda j, r: j.neighbour(r, False), "straggler", frozenset({"runq"})),
    "tbf": Fault("slow link (tc tbf 200 Mbit/s)", lambda j, r: j.shape(r, "200mbit"), lambda j, r: j.shape(r, None),
                 "straggler", frozenset({"nic_queue", "net_rtt"})),
    "loss": Fault("lossy link (3% of its packets dropped)", lambda j, r: j.lose(r, 0.03), lambda j, r: j.lose(r, None),
                  "straggler", frozenset({"net_retransmits", "net_rtt"})),
    "memory": Fault("memory limit under its data's page cache (v1, 64 MiB over its anonymous memory)",
                    lambda j, r: j.squeeze(r, True), lambda j, r: j.squeeze(r, False), "straggler",
                    frozenset({"memory_pressure", "memory_reclaim", "io_pressure"})),
    "reads": Fault("slow reads of data not in memory (blkio 16 MB/s)", lambda j, r: j.slow_reads(r, 16 << 20),
                   lambda j, r: j.slow_reads(r, None), "straggler", frozenset({"io_pressure"})),
    "gpu": Fault("slow GPU (a fake one: half its SM clock, a thermal clock-event reason)",
                 lambda j, r: j.slow_gpu(r, True), lambda j, r: j.slow_gpu(r, False), "straggler",
                 frozenset({"gpu_clock", "gpu_throttled"})),
    "imbalance": Fault("1.5x the batch (the job's own imbalance)", lambda j, r: j.more_work(r, 1.5),
                       lambda j, r: j.more_work(r, None), "imbalance"),
    "balanced": Fault("none (the job in step)", lambda j, r: None, lambda j, r: None, None),
}


DATA_FAULTS = ("memory", "reads")      # the ranks read a data file per step (DdpJob data_mb)
GPU_MS = 6.0                           # with "gpu": each rank's per-step wait for its (fake) GPU


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def named(cluster: Cluster) -> list[dict]:
    return [e for e in cluster.events() if e["event"] in KINDS]


def trial(cluster: Cluster, ddp: DdpJob, name: str, rank: int, rng: random.Random, timeout: float) -> dict:
    fault, node = FAULTS[name], cluster.nodes[rank]
    time.sleep(rng.uniform(8, 20))
    seen = len(named(cluster))
    t0 = time.time()
    fault.inject(ddp, rank)
    first, latency = None, None
    while time.time() - t0 < timeout:
        new = named(cluster)[seen:]
        if new:
            first, latency = new[0], time.time() - t0
            break
        time.sleep(0.2)
    t_clear = time.time()
    fault.clear(ddp, rank)
    if first is not None:                  # its end (or the timeout), then the job in step again
        key = "straggler" if first["event"] == "straggler" else "node"
        end = time.time()
        while time.time() - end < timeout and not any(
                e[key] == first[key] and e["t"] > first["t"] for e in cluster.events(first["event"] + "_end")):
            time.sleep(0.5)
    time.sleep(10)
    events = named(cluster)[seen:]
    verdict = judge(name, node, events, first)
    return {"fault": name, "rank": rank, "node": node, "t_fault": round(t0, 3), "t_clear": round(t_clear, 3),
            **verdict, "latency_s": round(latency, 1) if verdict["detected"] else None,
            "events": [(e["event"], e.get("straggler") or e.get("node"), e.get("causes", [])) for e in events]}


def judge(name: str, node: str, events: list[dict], first: dict | None) -> dict:
    """A trial's `straggler`/`imbalance` events (their bodies with `event`, in order) judged: detected when `first`
    (the first of them, if it came within the trial's time to name) names `node` with the fault's kind, its cause
    right, every other event a false name, the right node named again a flap (its event ended too soon). The bench's
    trials and scripts/straggler_replay.py's scoring both use it."""
    fault = FAULTS[name]
    right = [e for e in events if e["event"] == fault.kind and (e.get("straggler") or e.get("node")) == node]
    ok = first is not None and first in right
    return {"detected": ok,
            "right_cause": ok and (not fault.causes or bool(fault.causes & set(first.get("causes", ())))),
            "causes": first.get("causes", []) if first else [], "false_names": len(events) - len(right),
            "flaps": max(0, len(right) - 1)}


def bench_stragglers(runs: int, only: list[str], seed: int | None, progress: TextIO, timeout: float = 40.0) -> dict:
    import importlib.util

    from jobprobe.core.errors import BadInput
    from jobprobe.kernel.host import find_cgroup2_mount
    unknown = [f for f in only if f not in FAULTS]
    if unknown:
        raise BadInput(f"unknown fault {unknown[0]!r}: one of {', '.join(FAULTS)}")
    if importlib.util.find_spec("torch") is None:
        raise BadInput("PyTorch is not installed: `make bench` installs it (scripts/setup.sh --torch)")
    rng = random.Random(seed)
    plan = [f for f in (only or list(FAULTS)) for _ in range(runs)]
    rng.shuffle(plan)
    tmp = Path(tempfile.mkdtemp(prefix="jobprobe-bench-stragglers-"))
    mount = find_cgroup2_mount()
    if mount is None:
        raise BadInput("no cgroup2 hierarchy mounted: the ranks run in cgroups")
    data, gpu = any(f in plan for f in DATA_FAULTS), "gpu" in plan
    ddp = DdpJob(mount, seconds=1e6, parent="jobprobe-bench", data_mb=256 if data else 0, gpu_ms=GPU_MS if gpu else 0)
    cluster = Cluster(tmp, ddp, probes=PROBES + (",gpu" if gpu else ""))
    trials = []
    try:
        cluster.start_agents()
        ddp.start(tmp)
        cluster.attach()
        until(lambda: len(ddp.rates(0)) >= 3, 120, "the job to train")
        time.sleep(20)                      # every node's baseline (a minute at most) starts in step
        for i, name in enumerate(plan):
            r = trial(cluster, ddp, name, rng.randrange(ddp.world), rng, timeout)
            trials.append(r)
            print(f"[{i + 1}/{len(plan)}] {name} on {r['node']}: "
                  f"{'named in %.1f s' % r['latency_s'] if r['detected'] else 'not named'}"
                  f"{', causes ' + ','.join(r['causes']) if r['causes'] else ''}, {r['false_names']} false, "
                  f"{r['flaps']} flaps",
                  file=progress, flush=True)
    finally:
        cluster.close()
        ddp.close()
        if os.environ.get("JOBPROBE_KEEP"):       # its store, for scripts/straggler_replay.py
            print(f"kept {tmp}", file=progress, flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return summarize(trials, runs)


def summarize(trials: list[dict], runs: int) -> dict:
    rows = {}
    for name in dict.fromkeys(t["fault"] for t in trials):
        ts = [t for t in trials if t["fault"] == name]
        lat = [t["latency_s"] for t in ts if t["latency_s"] is not None]
        rows[name] = {"what": FAULTS[name].what, "trials": len(ts), "detected": sum(t["detected"] for t in ts),
                      "right_cause": sum(t["right_cause"] for t in ts),
                      "p50_s": percentile(lat, 50), "p90_s": percentile(lat, 90),
                      "false_names": sum(t["false_names"] for t in ts),
                      "flaps": sum(t.get("flaps", 0) for t in ts)}
    faulty = [t for t in trials if FAULTS[t["fault"]].kind]
    names = sum(t["detected"] for t in trials) + sum(t["false_names"] for t in trials)
    lat = [t["latency_s"] for t in trials if t["latency_s"] is not None]
    return {"runs": runs, "rows": rows, "trials": trials,
            "recall": sum(t["detected"] for t in faulty) / len(faulty) if faulty else None,
            "precision": sum(t["detected"] for t in trials) / names if names else None,
            "p50_s": percentile(lat, 50), "p90_s": percentile(lat, 90),
            "median_s": statistics.median(lat) if lat else None}


def markdown(res: dict) -> str:
    def f(x, fmt="{:.1f}"):
        return "—" if x is None else fmt.format(x)
    out = ["| fault | trials | named (right rank and kind) | right cause | time to name p50 / p90 | false names | "
           "named again (flaps) |", "|---|---|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        out.append(f"| {name}: {r['what']} | {r['trials']} | {r['detected']} | {r['right_cause']} | "
                   f"{f(r['p50_s'])} / {f(r['p90_s'])} s | {r['false_names']} | {r.get('flaps', 0)} |")
    out.append(f"\nrecall {f(res['recall'], '{:.2f}')}, precision {f(res['precision'], '{:.2f}')}, time to name "
               f"p50 {f(res['p50_s'])} s, p90 {f(res['p90_s'])} s")
    return "\n".join(out)
