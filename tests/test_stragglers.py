# SPDX-License-Identifier: Apache-2.0
"""Stragglers named on a real distributed job: PyTorch DDP (gloo, CPU), three ranks in three network namespaces on
a bridge, each rank its own node (three agents) reporting over NATS — all real (jobprobe/bench/ddp.py, which
`jobprobe bench stragglers` runs many times at random) — to four controllers, the server mapping each job's frames to
its partition: the job's three nodes would fall in different partitions by node, and its stragglers are named by
its partition's controller, and by no other.

One run, in phases, each fault on one rank: balanced (no event); a CPU limit (that node named "CPU throttled",
cleared when the limit goes, the job back in step before the next); a noisy neighbour (the rank pinned beside a CPU
hog: named for its run-queue wait, though its peers share a CPU); packet loss on its link; a memory limit under its
data's page cache, and its data read from a slow disk (each rank reads 8 MiB of its own data per step: both named for
I/O stalls); a slow GPU (a fake libnvidia-ml per node: each rank waits 6 ms per step for its "GPU", twice that at half
the clock, and its node's NVML reports the lower clock and a thermal reason); a slow link (tc tbf: named with network
evidence); and a rank given twice the batch — the job's own imbalance, named as such (no cause, not its node's
fault). After the CPU limit, the job back in step, the bigger batch; from then on the faults follow each other
without a pause, each on another rank than the one before, injected as that one is cleared: each named while its peer
is still getting back in step, and each one's end said.
Each named within 30 s (`jobprobe bench stragglers` measures the times: docs/PERFORMANCE.md), with the right cause,
and nobody else named at any time — the ranks that wait least of all.
Independent checks: the ranks' own step rates show the job really slowed, the kernel's cpu.stat, memory.failcnt and
blkio counts and tc's and iptables' counters show the cause really was there."""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import until, wait_for
from jobprobe.bench.ddp import PROBES, Cluster, DdpJob
from jobprobe.bench.ddpclock import lost_progress, lost_progress_band, more_blocked
from natsite import need_nats


def scrape(port: int) -> dict[tuple, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def blkio_read_bytes(ddp: DdpJob, rank: int) -> int:
    """What rank's group read from disks so far (v1 blkio.throttle.io_service_bytes, its Read lines)."""
    text = (ddp.v1x["blkio"][rank] / "blkio.throttle.io_service_bytes").read_text()
    return sum(int(ln.split()[2]) for ln in text.splitlines() if ln.split()[1:2] == ["Read"])


def window(cluster: Cluster, since: float) -> str:
    """Each node's compared figures per second of its frames since `since` (a failure's account)."""
    from jobprobe.cluster.causes import figures
    sums: dict[str, dict[str, float]] = {}
    for node, t, dt, probes in cluster.samples():
        if t >= since:
            acc = sums.setdefault(node, {"dt": 0.0})
            acc["dt"] += dt
            for k, v in figures(probes).items():
                acc[k] = acc.get(k, 0.0) + v
    return "; ".join(f"{n}: " + " ".join(f"{k}={v / max(a['dt'], 1e-9) / (1e9 if k.endswith('_ns') else 1):.3g}"
                                       for k, v in sorted(a.items()) if k != "dt") + f" over {a['dt']:.0f} s"
                     for n, a in sorted(sums.items()))


def summary_of(cluster: Cluster) -> dict:
    """`jobprobe summary --format json` of the job from its partition's store."""
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "summary", "--store", str(cluster.store), "--job",
                        cluster.job, "--format", "json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def rate(ddp: DdpJob, since: int) -> float:
    """The job's step rate (rank 0's prints) after its `since`-th print."""
    r = ddp.rates(0)[since:]
    return sum(r) / len(r) if r else 0.0


def test_the_lost_progress_reference_and_its_band():
    """A job at 10 steps/s, then 5 steps/s while limited (20-30 s), 8 steps/s for the 2 s it takes to get back in
    step, then 12 steps/s: 50 steps in the 10 s of the fault, which take 4.55 s at the mean of the paces around it
    (11 steps/s: 5.45 s lost), 5 s at the pace before alone (5 s lost), 4.17 s at the pace after alone (5.83 s)."""
    def done(t: float) -> float:
        return sum(r * max(0.0, min(t, b) - a) for a, b, r in ((0, 20, 10), (20, 30, 5), (30, 32, 8), (32, 99, 12)))
    steps = [(t / 4, done(t / 4)) for t in range(0, 200)]
    assert lost_progress(steps, (20.0, 30.0), (20.0, 30.0)) == pytest.approx(10 - 50 / 11)
    assert lost_progress_band(steps, (20.0, 30.0), (20.0, 30.0)) == (pytest.approx(5.0), pytest.approx(10 - 50 / 12))


@pytest.mark.serial
@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_ddp_stragglers_are_named_with_their_cause_and_a_balanced_job_has_none(cgroup2_mount, tmp_path):
    import importlib.util
    assert importlib.util.find_spec("torch"), "PyTorch is not installed: `make test` installs it (scripts/setup.sh)"
    from conftest import free_port
    ddp = DdpJob(cgroup2_mount, seconds=400, data_mb=128, gpu_ms=6)
    metrics = free_port()
    cluster = Cluster(tmp_path, ddp, probes=PROBES + ",gpu",
                      controller_args=("--metrics", f"127.0.0.1:{metrics}"), partitions=4)
    from jobprobe.core.wire import job_token, partition, token
    assert len({partition(token(n), 4) for n in cluster.nodes}) > 1    # by node, the job would have been split
    try:
        cluster.start_agents()
        ddp.start(tmp_path)
        cluster.attach()
        until(lambda: len(ddp.rates(0)) >= 3, 60, "the job to train")
        until(lambda: len({n for n, *_ in cluster.samples()}) == 3, 30, "frames of the three nodes")

        def named() -> list[tuple[str, str]]:
            return [(x["event"], x.get("straggler") or x.get("node")) for x in cluster.events()
                    if x["event"] in ("straggler", "straggler_end", "imbalance", "imbalance_end")]

        # (c) balanced: 20 s (twenty comparisons; a cause must hold for 4 s to name anyone), nobody named
        in_step = time.time()
        time.sleep(20)
        assert named() == [], cluster.events()
        in_step = (in_step, time.time())
        n0 = len(ddp.rates(0))
        balanced = rate(ddp, n0 - 3)

        # (a) rank 1's CPU limited to 0.1 cores (the job's pace a quarter of its own: the progress it loses is most
        # of the episode, which the job's own pace, moving 5-10% a minute here, cannot blur: docs/TIMEUSE.md)
        t0 = time.time()
        ddp.throttle(1, 0.1)
        ev = until(lambda: cluster.events("straggler"), 20, "a straggler named within 20 s of the CPU limit")
        named_after = time.time() - t0
        (e,) = ev
        print(f"stragglers: named {e['straggler']} {named_after:.1f} s after the limit: {e['reason']}")
        assert e["straggler"] == "node-b" and "cpu_throttled" in e["causes"] and "CPU throttled" in e["reason"]
        assert e["evidence"]["cpu_limit_cores"] == 0.1 and e["evidence"]["throttled_share"] > 0.2
        # the controller's /metrics says so too, and how fresh each node is
        m = scrape(metrics)
        assert m[("jobprobe_straggler", (("job", "ddp"), ("node", "node-b")))] == 1
        assert all(m[("jobprobe_node_last_frame_age_seconds", (("node", n),))] < 5 for n in cluster.nodes), m
        assert m[("jobprobe_stragglers_named_total", ())] == 1
        mine = f"{partition(job_token('ddp'), 4)}/4"                                  # the job's partition's
        assert m[("jobprobe_controller_active", (("partition", mine),))] == 1
        n1 = len(ddp.rates(0))
        time.sleep(3)
        slowed = rate(ddp, n1 - 1)
        assert slowed < 0.75 * balanced, (slowed, balanced)          # the whole job paced by the throttled rank
        cleared = time.time()
        ddp.throttle(1, None)
        until(lambda: cluster.events("straggler_end"), 30, "the straggler cleared after the limit went")
        until(lambda: ddp.steps(0)[-1][0] > cleared + 8, 10, "the job's pace 8 s after the limit went")
        # where the others' time went (`jobprobe summary` of the store): their waits in that episode above their
        # usual level for the work they did, as far as the progress they lost, were waits for node-b —
        # waiting_for_peers, attributed to it —, checked against two independent clocks: the progress the job lost
        # while node-b was limited, by rank 0's own step count against the job's pace around the limit
        # (lost_progress), and the ranks' own main thread's time blocked in collectives above its rate in step (its
        # schedstat, scripts/ddp_job.py: not all a rank loses to its peers, a lower bound).
        # `python scripts/peers_truth.py` (7 runs, 42 episodes x waiting ranks, rank 1 or 2 at 0.1 cores): 0.97-1.03x
        # the first, 1.26-1.42x the second. A rank's CPU per step, which the frames take for its progress, moves
        # while it waits (rank 2's 11.1 -> 9.6 ms once: docs/TIMEUSE.md)
        s = summary_of(cluster)
        (ep,) = s["stragglers"]
        lost = lost_progress(ddp.steps(0), (t0, cleared), (ep["start"], min(ep["end"], cleared + 2)))
        waited = {n: s["per_node"][n]["buckets"]["waiting_for_peers"] for n in ("node-a", "node-c")}
        # the ranks' own clock: their main thread's time blocked in collectives in the episode, less their usual
        own = {n: more_blocked(ddp.blocked(i), in_step, (ep["start"], ep["end"]))
               for i, n in ((0, "node-a"), (2, "node-c"))}
        print(f"stragglers: the others waited {waited} s for node-b in its {ep['s']} s episode; the job lost "
              f"{lost:.2f} s of progress; their own clocks {own}; paced by "
              f"{[d['pace'] for d in s['per_node'].values()]}; the limit {t0:.3f}-{cleared:.3f}, in step {in_step}")
        assert list(s["waited_for"]) == ["node-b"] and s["per_node"]["node-b"]["buckets"]["waiting_for_peers"] == 0
        assert all(0.9 * lost <= w <= 1.1 * lost and 0.9 * own[n] <= w for n, w in waited.items()), \
            (waited, lost, own, ep, cleared)
        # ranks that hold a (fake) GPU they never keep busy are paced by their CPU (once: all `other`, goodput 0)
        assert all(d["pace"]["of"] != "gpu_busy" and d["goodput"] > 0.2 for d in s["per_node"].values()), s

        ends: list = []      # the end each cleared fault still owes

        def ended() -> None:
            """The last cleared fault's end event, within 30 s of its clearing."""
            while ends:
                kind, key, node, e, what, cleared = ends.pop()
                until(lambda: [x for x in cluster.events(f"{kind}_end") if x[key] == node and x["t"] > e["t"]],
                      max(0.1, cleared + 30 - time.time()), f"the {kind} cleared within 30 s of {what} going")

        def fault(what: str, node: str, kind: str, inject, clear, causes: set[str], bound: float = 30) -> dict:
            """Inject, wait for `kind` naming `node` (`bound` s), clear; its event. The faults follow each other
            without a pause, each on another node than the one before: the next is injected as this one is cleared,
            and this one's end (within 30 s of its clearing) is checked once the next is named — a fault named while
            its peer is still getting back in step, in its peer's wake (before, each waited ~7 s for the one before
            to end: 50 s of the suite)."""
            before = len(cluster.events(kind))
            t0 = time.time()
            n0 = len(ddp.rates(0))
            inject()
            try:
                e = until(lambda: cluster.events(kind)[before:], bound, f"{kind} named within {bound} s of {what}")[0]
            except AssertionError as err:       # what the detector had before it: did the fault slow the job?
                raise AssertionError(f"{err}; the job {rate(ddp, n0 - 3):.1f} steps/s before, "
                                     f"{rate(ddp, n0):.1f} after; {window(cluster, t0)}") from None
            print(f"stragglers: {kind} {node} {time.time() - t0:.1f} s after {what}: {e['reason']}")
            key = "straggler" if kind == "straggler" else "node"
            assert e[key] == node, e
            assert not causes or causes & set(e["causes"]), e
            ended()
            clear()
            ends.append((kind, key, node, e, what, time.time()))
            return e

        # (i) rank 1 given twice the batch: the job's own imbalance, not a fault of its node (no cause) — first, the
        # job in step. At 1.5x (`jobprobe bench stragglers --only imbalance` measures how soon that is named) its CPU
        # share rises 1.16-1.35x its usual ratio on this machine against the bound's 1.18x: once its usual share was
        # 1.05x its peers' and the rise 1.16-1.17x, never named within 30 s (scripts/straggler_replay.py on the run's
        # store) — this test is of the verdict (more work, no cause), not of the bound's reach
        e = fault("the bigger batch", "node-b", "imbalance", lambda: ddp.more_work(1, 2.0),
                  lambda: ddp.more_work(1, None), set())
        assert e["verdict"] == "imbalance" and "causes" not in e and e["waited_by"], e
        # the rank's own word that it took the bigger batch (and back): here, reading its data each step and waiting
        # for its fake GPU, the job slows only ~3% (36.8 -> 35.6 steps/s once) while the others wait 0.14 s/s more
        # (back: within a few steps of the clearing, which the next fault no longer waits for)
        def took() -> list[str]:
            return [line.split(": ", 1)[1] for line in ddp.logs[1].read_text().splitlines() if ": work x" in line]
        wait_for(lambda: took()[-1:] == ["work x1"], 10)
        assert took()[-2:] == ["work x2", "work x1"], took()

        # (e) 3% of what rank 0 sends dropped (rank 0 waits more than the others all run: its own usual gap)
        e = fault("the packet loss", "node-a", "straggler", lambda: ddp.lose(0, 0.03), lambda: ddp.lose(0, None),
                  {"net_retransmits", "net_rtt"})
        # (d) a noisy neighbour: rank 1 pinned to CPU 1 beside a hog; its peers share CPU 0 — named for its own
        # run-queue wait (it rose over its baseline), though its peers' is as high
        e = fault("the noisy neighbour", "node-b", "straggler", lambda: ddp.neighbour(1, True),
                  lambda: ddp.neighbour(1, False), {"runq"})
        assert e["waited_by"], e
        # (f) rank 2's memory limited under its data's page cache (v1 memory.limit_in_bytes): each pass over its
        # data reclaims its cache and reads it again from the disk — the kernel's own counts say so: the limit was
        # hit (memory.failcnt) and the rank read far more than its data from the disk (blkio)
        read0 = blkio_read_bytes(ddp, 2)
        e = fault("the memory limit", "node-c", "straggler", lambda: ddp.squeeze(2, True),
                  lambda: ddp.squeeze(2, False), {"io_pressure", "memory_pressure", "memory_reclaim"})
        assert int((ddp.v1x["memory"][2] / "memory.failcnt").read_text()) > 0 and "at its memory limit" in e["reason"]
        assert blkio_read_bytes(ddp, 2) - read0 > 2 * (ddp.data_mb << 20), blkio_read_bytes(ddp, 2) - read0
        # (g) rank 1's data not in memory, read from a disk throttled to 32 MB/s (v1 blkio)
        read0 = blkio_read_bytes(ddp, 1)
        e = fault("the slow reads", "node-b", "straggler", lambda: ddp.slow_reads(1, 32 << 20),
                  lambda: ddp.slow_reads(1, None), {"io_pressure"})
        assert blkio_read_bytes(ddp, 1) - read0 > 32 << 20
        # (h) rank 0's GPU (a fake one: no GPU here) at half its clock: its per-step wait doubles, its NVML says so
        e = fault("the slow GPU", "node-a", "straggler", lambda: ddp.slow_gpu(0, True), lambda: ddp.slow_gpu(0, False),
                  {"gpu_clock", "gpu_throttled"})
        assert e["evidence"]["gpu_sm_clock_mhz"] < e["evidence"]["peers_gpu_sm_clock_mhz"], e["evidence"]
        # (j) rank 1 paused (SIGSTOP) — no figure of its node says why it is slow, its threads say they are stopped
        # (the sched probe's own reason): named all the same, cause unknown, "paused"; SIGCONT brings it back
        rank1 = ddp.procs[1].pid
        e = fault("the pause", "node-b", "straggler", lambda: os.kill(rank1, signal.SIGSTOP),
                  lambda: os.kill(rank1, signal.SIGCONT), {"unknown"})
        assert "paused" in e["reason"] and e["evidence"]["stopped_s_per_s"] > 0.3, e
        # (b) rank 2's link shaped: 200 Mbit/s out of its namespace
        t0 = time.time()
        n0 = len(ddp.rates(0))
        ddp.shape(2, "200mbit")
        try:
            ev = until(lambda: cluster.events("straggler")[7:], 20, "a straggler named within 20 s of the shaping")
        except AssertionError as err:     # a CI run timed out here once, with no account: did the job slow, who
            since = [(x["event"], x.get("straggler") or x.get("node"), str(x.get("reason"))[:100])
                     for x in cluster.events() if x.get("t", 0) >= t0 - 1]     # waited, was anything else named
            raise AssertionError(f"{err}; the job {rate(ddp, n0 - 3):.1f} steps/s before, {rate(ddp, n0):.1f} "
                                 f"after; tc {ddp.tc_stats(2)}; named since {since}; {window(cluster, t0)}") from None
        e = ev[0]
        ended()
        print(f"stragglers: named {e['straggler']} {time.time() - t0:.1f} s after the shaping: {e['reason']}")
        assert e["straggler"] == "node-c" and "nic_queue" in e["causes"] and "network" in e["reason"]
        assert e["evidence"]["nic_queue_held_per_s"] > 50 and e["evidence"]["peers_nic_queue_held_per_s"] < 10
        assert ddp.tc_stats(2)["overlimits"] > 0                      # tc saw the queue hold packets back
        # (its end is the same code path as the CPU limit's, checked above: not waited for again, ~20 s)
        # nobody else named, ever: each node's events in their order (one fault's end and the next one's naming, on
        # another node, come in either order)
        got = named()
        assert {m for _, m in got} <= set(cluster.nodes), got
        assert {n: [x for x, m in got if m == n] for n in cluster.nodes} == {
            "node-a": ["straggler", "straggler_end"] * 2,
            "node-b": ["straggler", "straggler_end", "imbalance", "imbalance_end"] + ["straggler", "straggler_end"] * 3,
            "node-c": ["straggler", "straggler_end", "straggler"]}, got
        import sqlite3  # named by its partition's controller alone
        for other in (s for s in cluster.stores if s != cluster.store):
            db = sqlite3.connect(f"file:{other}?mode=ro", uri=True)
            assert db.execute("SELECT COUNT(*) FROM frames").fetchone()[0] == 0, other
            db.close()
    finally:
        cluster.close()
        ddp.close()
        for i in range(3):
            log = tmp_path / f"rank{i}.log"
            if log.exists():
                print(f"rank {i}: {log.read_text()[-300:]}")
        if os.environ.get("JOBPROBE_KEEP"):
            print(f"kept {tmp_path}")
