# SPDX-License-Identifier: Apache-2.0
"""The straggler comparison on frames made here (the DDP tests in test_stragglers.py run it on a real job): a
balanced job names nobody, one node's cause opens an event only after it holds twice and closes after it is gone
twice; noise in one window names nobody; a node whose probes lack a figure is not compared on it."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from jobprobe.cluster.stragglers import UNKNOWN_OPEN_S, StragglerWatch, Window, causes, figures
from jobprobe.core.schema import FIELDS

ROOT = Path(__file__).resolve().parents[1]


def every_field() -> dict:
    """A frame's probes with every field the schema declares (1 for a number, 1.0 for a float; one item in each
    list of records, with every field of its own)."""
    probes: dict = {}
    for name, decl in FIELDS.items():
        d = probes.setdefault(name, {})
        for key, t in decl.items():
            value = 1.0 if t == "float" else 1 if t == "int" else None
            if value is None:
                continue
            if "[]." in key:
                outer, inner = key.split("[].", 1)
                d.setdefault(outer, [{}])[0][inner] = value
            else:
                d[key] = value
    return probes


def test_the_detector_reads_every_figure_from_fields_probes_send():
    """A frame holding every declared field gives the detector every figure it compares (a figure read under a
    name no probe sends — `memory_some_ns` for pressure's `mem_some_ns` — left memory stalls out of every
    decision while the tests' own frames used the same wrong name)."""
    got = figures(every_field())
    want = {"cpu_ns", "throttled_ns", "limit", "runq_ns", "wait_ns", "mem_stall_ns", "io_stall_ns", "reclaim_ns",
            "tx_bytes", "retrans", "rtt_w", "nic_held", "rail_slow", "rdma_fatal", "gpu_util", "gpu_clock",
            "gpu_throttled"}
    assert want <= set(got), sorted(want - set(got))
    from jobprobe.cluster.peers import KEYS
    assert set(got) <= set(KEYS), sorted(set(got) - set(KEYS))      # each one summed in the nodes' arrays


def frame(node: str, t: float, cpu=0.9e9, throttled=0, runq=0.02e9, wait=0.3e9, retrans=0, gpu=None, limit=None,
          nic=None, rdma=None, mem_stall=None, stopped=0, dstate=0):
    cg = {"cpu_user_ns": int(cpu), "cpu_system_ns": 0, "cpu_throttled_ns": int(throttled)}
    if limit:
        cg["cpu_limit_cores"] = limit
    probes = {"cgroup": cg, "sched": {"runq_lat_ns": int(runq), "offcpu_lock_ns": int(wait), "offcpu_wait_ns": 0,
                                      "offcpu_stopped_ns": int(stopped), "offcpu_io_ns": int(dstate)},
              "net": {"tcp_tx_bytes": 10 << 20, "tcp_rx_bytes": 10 << 20, "tcp_retransmits": retrans}}
    if gpu:
        probes["gpu"] = {"gpus": [gpu]}
    if nic is not None:
        probes["nic"] = nic
    if rdma is not None:
        probes["rdma"] = rdma
    if mem_stall is not None:
        probes["pressure"] = {"mem_some_ns": int(mem_stall), "io_some_ns": 0}
    for name, d in probes.items():      # only fields a probe sends (a name made up here once hid a detector's typo)
        assert set(d) <= set(FIELDS[name]), (name, set(d) - set(FIELDS[name]))
    return {"v": 1, "kind": "sample", "node": node, "job": "j", "run": "r", "seq": int(t), "t": t, "dt": 1.0,
            "probes": probes}


NOISY = ("cpu", "wait", "runq", "mem_stall")


def run(watch: StragglerWatch, seconds: int, special=lambda node, t: {}, nodes=("a", "b", "c"), t0=1000.0,
        noisy: bool = False):
    """`noisy`: the levels `special` gives to NOISY figures vary by ±10% frame to frame, as real ones do."""
    events = []
    rng = random.Random(1)
    for s in range(seconds):
        t = t0 + s
        batch = []
        for n in nodes:
            kw = {"cpu": 0.9e9 * rng.uniform(0.9, 1.1), "wait": 0.3e9 * rng.uniform(0.8, 1.2)}
            for k, v in special(n, t).items():
                kw[k] = v * rng.uniform(0.9, 1.1) if noisy and k in NOISY and isinstance(v, float) else v
            batch.append(frame(n, t, **kw))
        rng.shuffle(batch)
        events += [(t, *e) for e in watch.feed(batch)]
    return events


def test_a_balanced_job_names_nobody():
    w = StragglerWatch()
    assert run(w, 300) == [] and w.evaluations >= 55


def test_a_throttled_node_is_named_after_4_s_and_cleared_after_it_recovers():
    w = StragglerWatch()
    throttled = lambda n, t: {"throttled": 0.6e9, "limit": 0.25, "wait": 0.05e9} if n == "b" and 1060 <= t < 1120 \
        else ({"wait": 0.7e9} if 1060 <= t < 1120 else {})
    ev = run(w, 200, throttled)
    assert [(e[1], e[3]) for e in ev] == [("b", "straggler"), ("b", "straggler_end")], ev
    t_open, _, _, _, body = ev[0]
    assert 1060 + 4 <= t_open <= 1060 + 7               # held 4 s (a decision each second), first seen at once
    share = 0.6 * min(10, t_open - 1059) / 10           # what the last 10 s held when it was named
    assert body["causes"] == ["cpu_throttled"] and f"CPU throttled {share:.0%}" in body["reason"]
    assert "limit 0.25 cores" in body["reason"] and "waited" in body["reason"]
    assert body["evidence"]["cpu_throttled"] == {"value": round(share, 3), "peers": 0.0}
    t_end = ev[1][0]
    assert 1120 < t_end <= 1120 + 13 and ev[1][4]["duration_s"] >= 55


def test_one_noisy_window_names_nobody():
    w = StragglerWatch()
    assert run(w, 120, lambda n, t: {"retrans": 200} if n == "c" and 1050 <= t < 1052 else {}) == []   # 2 s
    w = StragglerWatch()                                                                  # (3 s: named)
    assert named(run(w, 120, lambda n, t: {"retrans": 200} if n == "c" and 1050 <= t < 1053 else {}))


def test_a_lossy_link_and_a_slow_gpu_are_named_with_their_evidence():
    w = StragglerWatch()
    ev = run(w, 60, lambda n, t: {"retrans": 40} if n == "c" and t >= 1020 else {})
    assert [(e[1], e[3]) for e in ev] == [("c", "straggler")] and ev[0][4]["causes"] == ["net_retransmits"]
    w = StragglerWatch()
    gpu = lambda n, t: {"gpu": {"util_gpu_pct": 95 if n != "a" or t < 1020 else 40, "sm_clock_mhz": 1980,
                                "clock_event_reasons": 0}}
    ev = run(w, 60, gpu)
    assert [(e[1], e[3]) for e in ev] == [("a", "straggler")] and ev[0][4]["causes"] == ["gpu_util"]


def test_a_node_with_a_slow_rail_or_a_dead_rdma_port_is_named():
    """The nic probe's rail comparison and the rdma probe's verdicts, across nodes: node b's second rail slow from
    t = 1020 (every other node's rails even) — a straggler for its rail; node c's RDMA port fatal — for its port."""
    w = StragglerWatch()
    rails = lambda n, t: {"nic": {"rails": 2, "rails_slow": int(n == "b" and t >= 1020)}}     # noqa: E731
    ev = run(w, 60, rails)
    assert [(e[1], e[3]) for e in ev] == [("b", "straggler")] and ev[0][4]["causes"] == ["nic_rail"]
    assert "one of its rails carried under half" in ev[0][4]["reason"]
    w = StragglerWatch()
    ports = lambda n, t: {"rdma": {"ports_fatal": int(n == "c" and t >= 1020), "ports_degraded": 0}}  # noqa: E731
    ev = run(w, 60, ports)
    assert [(e[1], e[3]) for e in ev] == [("c", "straggler")] and ev[0][4]["causes"] == ["rdma_port"]
    w = StragglerWatch()
    assert run(w, 60, lambda n, t: {"nic": {"rails": 2, "rails_slow": 0}}) == []


def test_figures_absent_are_not_compared():
    me, peer = Window(10.0, figures({"cgroup": {"cpu_user_ns": 9, "cpu_system_ns": 0}})), Window(10.0, {})
    assert causes(me, [peer, peer]) == []
    assert "throttled_ns" not in figures({"cgroup": {"cpu_user_ns": 1, "cpu_system_ns": 1}})


def test_peers_median_and_max_leave_the_node_itself_out_exactly():
    import statistics

    from jobprobe.cluster.stragglers import Others
    rng = random.Random(7)
    for n in (2, 3, 4, 9, 50):
        wins = [Window(10.0, {"retrans": float(rng.choice([0, 1, 5, 5, 20, 300]))}) for _ in range(n)]
        everyone = Others(wins)
        for i, w in enumerate(wins):
            rest = [x.rate("retrans") for j, x in enumerate(wins) if j != i]
            med, top, cnt = everyone.stats("retrans", w.rate("retrans"))
            assert (med, top, cnt) == (statistics.median(rest), max(rest), n - 1)


def test_the_arrays_order_of_a_figure_is_the_peers_median_and_max_of_each_job():
    """order_stats, every node of several jobs at once (a node without the figure: NaN), gives what Others.stats
    and statistics give each node against the other nodes of its own job."""
    import statistics

    import numpy as np

    from jobprobe.cluster.peers import order_stats
    rng = random.Random(3)
    sizes = [2, 3, 4, 9, 1, 50]
    x = np.array([[rng.choice([np.nan, 0.0, 1.0, 5.0, 5.0, 20.0, rng.random()]) for _ in range(sum(sizes))]
                  for _ in range(3)])
    starts = np.cumsum([0] + sizes[:-1])
    med, top, cnt = order_stats(x, np.repeat(np.arange(len(sizes)), sizes), starts)
    for f in range(len(x)):
        for j, (a, m) in enumerate(zip(starts, sizes)):
            for i in range(a, a + m):
                rest = [v for k, v in enumerate(x[f, a:a + m].tolist(), a) if k != i and v == v]
                want = (statistics.median(rest), max(rest), len(rest)) if rest else (0.0, 0.0, 0)
                assert (med[f, i], top[f, i], cnt[f, i]) == want, (f, j, i)


def named(ev):
    return [(e[1], e[3]) for e in ev]


def test_a_noisy_neighbour_on_one_ranks_cpu_is_named_though_its_peers_share_a_cpu():
    """Rank b pinned beside a CPU hog from t = 1060: its run-queue wait rises 0.42 -> 1.34 s/s while its peers'
    (sharing a CPU with each other) fall 0.6 -> 0.5 — b's is not 3x theirs, so comparing with the peers alone names
    nobody. But the others now wait for b (their waits 0.3 -> 0.6 s/s, b's 0.3 -> 0.1) and b's own run-queue wait
    rose over its baseline: b is named for it, and nobody else."""
    w = StragglerWatch()

    def hog(n, t):
        if t < 1060:
            return {"runq": 0.42e9 if n == "b" else 0.6e9}
        return {"runq": 1.34e9, "wait": 0.1e9} if n == "b" else {"runq": 0.5e9, "wait": 0.6e9}
    ev = run(w, 150, hog, noisy=True)
    assert named(ev) == [("b", "straggler")], ev
    t, _, _, _, body = ev[0]
    assert t - 1060 <= 12 and body["causes"] == ["runq"] and body["verdict"] == "node"
    assert "up from 0.4" in body["reason"] and body["waited_by"] == ["a", "c"], body


def test_the_rank_that_waits_is_never_named_for_a_figure_that_did_not_move():
    """Two ranks: s slowed by a neighbour (run queue up, its retransmits down 24 -> 4/s as it sends less), v waiting
    for it (wait up) with its retransmits where they were (24 -> 25.4/s): 25.4 is over 5x the peer's 4 + 5, which
    named v before. Now only s is named, for its run-queue wait; v, waiting, never."""
    w = StragglerWatch()

    def fault(n, t):
        if t < 1060:
            return {"runq": 0.4e9, "retrans": 24}
        if n == "s":
            return {"runq": 1.3e9, "wait": 0.1e9, "retrans": 4}
        return {"runq": 0.3e9, "wait": 0.7e9, "retrans": 25 + (t % 2) * 0.8}
    ev = run(w, 150, fault, nodes=("s", "v"), noisy=True)
    assert named(ev) == [("s", "straggler")], ev
    assert ev[0][4]["causes"] == ["runq"] and ev[0][4]["waited_by"] == ["v"]


def test_a_rank_given_more_work_is_the_jobs_own_imbalance_not_a_node_fault():
    """Rank c given 1.5x the batch from t = 1060: its CPU rises 0.9 -> 1.35 cores, the others wait for it, nothing
    on its node changed (no run-queue wait, throttling, stall or network figure moved): an `imbalance` event for c,
    no straggler; it ends when c is no longer waited for."""
    w = StragglerWatch()

    def more_work(n, t):
        if not 1060 <= t < 1130:
            return {}
        return {"cpu": 1.35e9, "wait": 0.05e9} if n == "c" else {"wait": 0.7e9}
    ev = run(w, 200, more_work, noisy=True)
    assert named(ev) == [("c", "imbalance"), ("c", "imbalance_end")], ev
    body = ev[0][4]
    assert body["verdict"] == "imbalance" and "more work" in body["reason"] and body["waited_by"] == ["a", "b"]
    assert w.named == 0 and w.open() == []


def test_memory_pressure_on_one_rank_is_named():
    w = StragglerWatch()
    stall = lambda n, t: {"mem_stall": 0.45e9, "wait": 0.05e9} if n == "a" and t >= 1060 else \
        ({"mem_stall": 0.01e9, "wait": 0.6e9} if t >= 1060 else {"mem_stall": 0.01e9})      # noqa: E731
    ev = run(w, 120, stall, noisy=True)
    assert named(ev) == [("a", "straggler")] and ev[0][4]["causes"] == ["memory_pressure"], ev


def test_a_figure_far_from_the_peers_but_where_it_always_was_is_no_cause():
    """Node a has always had 40 retransmits/s (its own link, its own baseline); its peers none, and nobody waits
    for it. Far from the peers is not enough: it did not move, so it names nobody — while a rise on node b from 0
    to 200 (far from its peers' median, 20) is named."""
    w = StragglerWatch()
    assert run(w, 150, lambda n, t: {"retrans": 40} if n == "a" else {}) == []
    w = StragglerWatch()
    ev = run(w, 150, lambda n, t: {"retrans": 40} if n == "a" else ({"retrans": 200} if n == "b" and t >= 1060
                                                                   else {}))
    assert named(ev) == [("b", "straggler")] and ev[0][4]["causes"] == ["net_retransmits"], ev


def test_a_straggler_whose_cause_went_is_cleared_though_it_still_waits_a_little_less_than_its_peers():
    """b throttled from t = 1060 to 1120; after, its cause is gone but its threads go on waiting a little less than
    its peers' (0.2 against 0.3 s/s: over the 'waited for' bound, as a rank's place in the ring can make it on a
    busy machine). Nothing of b's own moved any more: the episode ends within the clearing comparisons — it used
    to stay open for as long as the job ran (the DDP test waited 40 s for an end that never came)."""
    w = StragglerWatch()

    def fault(n, t):
        if 1060 <= t < 1120:
            return {"throttled": 0.6e9, "limit": 0.25, "runq": 0.7e9, "wait": 0.05e9} if n == "b" \
                else {"wait": 0.7e9}
        return {"wait": 0.2e9} if n == "b" and t >= 1120 else {}
    ev = run(w, 220, fault)
    assert named(ev) == [("b", "straggler"), ("b", "straggler_end")], ev
    assert 1120 < ev[1][0] <= 1120 + 15, ev


def test_a_straggler_whose_cause_went_is_cleared_while_it_waits_for_the_next_one():
    """b throttled from t = 1060 to 1120; at 1120 a's GPU drops to half its clock, so b and c wait for a from then
    on, and b's GPU, waiting, is less busy than a's (70% against 95%: far enough from its peers to hold an open
    event at the clearing bounds, not to name one). b's episode ends as it would alone — it was held open for as
    long as a was slow, by a cause it was never named for (the DDP test, its faults back to back: 30 s)."""
    w = StragglerWatch()

    def fault(n, t):
        gpu = {"util_gpu_pct": 95, "sm_clock_mhz": 1980, "clock_event_reasons": 0}
        if 1060 <= t < 1120:
            return {"throttled": 0.6e9, "limit": 0.25, "runq": 0.7e9, "wait": 0.05e9, "gpu": gpu} if n == "b" \
                else {"wait": 0.7e9, "gpu": gpu}
        if t >= 1120:
            if n == "a":
                return {"wait": 0.05e9, "gpu": {**gpu, "sm_clock_mhz": 990}}
            return {"wait": 0.7e9, "gpu": {**gpu, "util_gpu_pct": 70 if n == "b" else 95}}
        return {"gpu": gpu}
    ev = run(w, 220, fault)
    assert sorted(named(ev)) == [("a", "straggler"), ("b", "straggler"), ("b", "straggler_end")], ev
    assert [1120 < t <= 1120 + 15 for t, n, _, kind, _ in ev if (n, kind) == ("b", "straggler_end")] == [True], ev


def learning(monkeypatch, fault, seconds: int = 200) -> tuple[list, list[float]]:
    """Nodes a, b and c, each at 0.9 cores and `fault`'s figures, one frame a second from t = 1000: the events, and
    when the figures of a comparison in step joined the baselines."""
    from jobprobe.cluster import peers
    learnt: list[float] = []
    now = [0.0]
    real = peers.Sums.in_step
    monkeypatch.setattr(peers.Sums, "in_step", lambda self, r, v: (learnt.append(now[0]), real(self, r, v)))
    w = StragglerWatch()
    ev = []
    for s in range(seconds):
        now[0] = 1000.0 + s
        ev += [(now[0], *e) for e in w.feed([frame(n, now[0], **{"cpu": 0.9e9, **fault(n, now[0])})
                                              for n in ("a", "b", "c")])]
    return ev, learnt


def test_a_rank_given_more_work_while_another_is_the_straggler_is_not_in_step(monkeypatch):
    """c throttled from t = 1060 to 1120; a given 1.5x the batch from 1110 on. While c is the straggler a's
    imbalance is not named (it may be the CPU c let go), and the job is not in step either: no node's figures join
    their baselines from a's first such verdict until a is named, after c's end. They did in the comparison where c
    ended (a, compared before c, was neither holding nor open): in the real DDP job, its faults back to back, the
    rank's bigger CPU was learnt as its usual, its 10% rise fell under the bound, and it was never named."""
    def fault(n, t):
        if 1060 <= t < 1120 and n == "c":
            return {"throttled": 0.6e9, "limit": 0.25, "runq": 0.7e9, "wait": 0.05e9}
        if t >= 1110 and n == "a":
            return {"cpu": 1.35e9, "wait": 0.05e9}
        return {"wait": 0.7e9} if t >= 1060 else {}
    ev, learnt = learning(monkeypatch, fault)
    assert named(ev) == [("c", "straggler"), ("c", "straggler_end"), ("a", "imbalance")], ev
    named_at = ev[2][0]
    assert not [t for t in learnt if 1110 <= t <= named_at], (learnt, named_at)


def test_a_baseline_learns_no_window_that_held_an_episode(monkeypatch):
    """b throttled from t = 1060 to 1120. The job is in step again once b's straggler ends, but the figures that
    would join the baselines are the window's (its last 10 s): until b's last throttled second has left it, they
    hold b's low CPU and its peers' waits for it. Learnt then (they were: the first after the end), a rank's usual
    took in the episode's tail, and the next fault on it was told against that."""
    from jobprobe.cluster.stragglers import WINDOW_S

    def fault(n, t):
        if 1060 <= t < 1120:
            return {"throttled": 0.6e9, "limit": 0.25, "cpu": 0.3e9, "wait": 0.05e9} if n == "b" else {"wait": 0.7e9}
        return {}
    ev, learnt = learning(monkeypatch, fault)
    assert named(ev) == [("b", "straggler"), ("b", "straggler_end")], ev
    opened, ended = ev[0][0], ev[1][0]
    assert ended < 1119 + WINDOW_S, ev                  # (the end comes while the window still holds the fault)
    assert not [t for t in learnt if opened <= t < 1119 + WINDOW_S], (learnt, opened, ended)
    assert [t for t in learnt if t >= 1119 + WINDOW_S], learnt         # and the job in step is learnt again


def test_a_job_in_step_for_20_s_has_every_nodes_baseline_when_a_fault_comes():
    """Baselines are what a cause must have moved from and what an imbalance rises over: a job in step for 20 s
    (the DDP test's stretch before its first fault) must have them all when its first fault comes — a rule that
    learnt each comparison in step only once 10 s more had passed with nothing held learnt 3 in the DDP test's
    stretch, dropped the 2 pending at the fault, and a rank never had one: its imbalance was never named."""
    w = StragglerWatch()
    run(w, 23)                      # frames from 1000 to 1022; the fault would come at 1023
    sums = w.jobs["j"].sums
    for key in ("cpu", "cpu_share", "gap"):
        assert all(sums.baseline(sums.rows[n], key) is not None for n in "abc"), key


def test_a_rank_that_always_waits_more_hides_nobody():
    """Rank a waits 1 s/s more than its peers for the whole run (as rank 0 did in a DDP run here), so by the raw
    comparison b is 'waited for' from the first second and c, whose link is shaped, is just under the bound. Being
    waited for is judged against each node's own usual gap: the balanced job names nobody, and when
    c's link is shaped at t = 1060 (its interface's queue holds packets back, its waits unchanged) c is named for
    it — before, c's 'waited for' was never clear of a's offset and nothing in the job ever had a baseline."""
    before, after = {"a": 4.0e9, "b": 2.85e9, "c": 3.0e9}, {"a": 4.85e9, "b": 3.69e9, "c": 3.86e9}   # a DDP run's
    shaped = lambda n, t: {"wait": (after if t >= 1060 else before)[n],                       # noqa: E731
                           "nic": {"nics": [{"qdisc_overlimits": 30000 if n == "c" and t >= 1060 else 0}]}}
    w = StragglerWatch()
    assert run(w, 150, lambda n, t: {**shaped(n, t), "nic": {"nics": [{}]}}) == []
    w = StragglerWatch()
    ev = run(w, 150, shaped)
    assert named(ev) == [("c", "straggler")] and ev[0][4]["causes"] == ["nic_queue"], ev
    assert ev[0][0] - 1060 <= 12


def test_an_nccl_job_is_compared_on_its_ranks_waits_in_cuda_synchronize_and_nccl_calls():
    """No sched probe: GPU ranks wait for their peers inside cudaStreamSynchronize and NCCL calls (the cuda
    probe's uprobes), often spinning on a CPU. Rank b's SM clock falls from 1980 to 1400 MHz at t = 1060: the
    others' synchronize time rises, b's falls — b is waited for, and named for its clock."""
    w = StragglerWatch()

    def gpu(n, t):
        slow = n == "b" and t >= 1060
        sync = (0.05e9 if n == "b" else 0.6e9) if t >= 1060 else 0.2e9
        f = frame(n, t, gpu={"util_gpu_pct": 95, "sm_clock_mhz": 1400 if slow else 1980, "clock_event_reasons": 0})
        del f["probes"]["sched"]
        f["probes"]["cuda"] = {"sync_ns": int(sync * 0.7), "nccl_allreduce_ns": int(sync * 0.3)}
        return f
    events = []
    for s in range(150):
        events += [(1000 + s, *e) for e in w.feed([gpu(n, 1000.0 + s) for n in "abc"])]
    assert named(events) == [("b", "straggler")] and events[0][4]["causes"] == ["gpu_clock"], events
    assert events[0][4]["waited_by"] == ["a", "c"] and events[0][0] - 1060 <= 12


def test_nccls_own_word_who_is_behind_says_who_is_waited_for():
    """Only NCCL's RAS port says who waits (no sched or cuda probe): polled every 5 s, b's rank is behind its
    communicator's count in every poll from t = 1060, when its SM clock falls; the others never are. b is named
    for its clock, waited for by a and c."""
    w = StragglerWatch()

    def frame_of(n, t):
        slow = n == "b" and t >= 1060
        f = frame(n, t, gpu={"util_gpu_pct": 95, "sm_clock_mhz": 1400 if slow else 1980, "clock_event_reasons": 0})
        del f["probes"]["sched"]
        f["probes"]["ncclras"] = {"polled": int(t) % 5 == 0, "ranks_behind_here": int(slow)}
        return f
    events = []
    for s in range(150):
        events += [(1000 + s, *e) for e in w.feed([frame_of(n, 1000.0 + s) for n in "abc"])]
    assert named(events) == [("b", "straggler")] and events[0][4]["causes"] == ["gpu_clock"], events
    assert events[0][4]["waited_by"] == ["a", "c"], events
    # and a rank given more work (its CPU up 1.5x, nothing on its node changed): NCCL's word is the only sign that
    # the others wait for it — the job's own imbalance
    w = StragglerWatch()

    def more_work(n, t):
        heavy = n == "c" and t >= 1060
        f = frame(n, t, cpu=1.35e9 if heavy else 0.9e9)
        del f["probes"]["sched"]
        f["probes"]["ncclras"] = {"polled": int(t) % 5 == 0, "ranks_behind_here": int(heavy)}
        return f
    events = []
    for s in range(150):
        events += [(1000 + s, *e) for e in w.feed([more_work(n, 1000.0 + s) for n in "abc"])]
    assert named(events) == [("c", "imbalance")] and events[0][4]["waited_by"] == ["a", "b"], events


def test_every_event_the_watch_makes_goes_through_the_controller_into_its_store(tmp_path):
    """The controller turns each (node, job, name, body) into a stored event frame: a straggler and its end, an
    imbalance (whose body names its `node`, as the frame does) and its end — the imbalance used to fail there
    ("got multiple values for argument 'node'"), so no imbalance ever reached the store."""
    from jobprobe.cluster.controller import Controller
    from jobprobe.cluster.store import Store
    ctl = Controller(Store(tmp_path / "s.db"), "nats://unused")

    def more_work(n, t):
        if not 1060 <= t < 1130:
            return {}
        return {"cpu": 1.35e9, "wait": 0.05e9} if n == "c" else {"wait": 0.7e9}
    out = []
    rng = random.Random(1)
    for s in range(200):
        t = 1000.0 + s
        batch = [frame(n, t, **{"cpu": 0.9e9 * rng.uniform(0.9, 1.1), "wait": 0.3e9 * rng.uniform(0.8, 1.2),
                                **more_work(n, t)}) for n in "abc"]
        out += ctl.straggler_events(batch, t)
    assert [(e["event"], e["node"], e["kind"], e["run"]) for e in out] == [
        ("imbalance", "c", "event", "controller"), ("imbalance_end", "c", "event", "controller")], out
    assert out[0]["verdict"] == "imbalance" and out[0]["waited_by"] == ["a", "b"]


def test_more_work_on_a_machine_the_ranks_share_is_read_from_the_cpu_share():
    """The DDP bench's numbers: three ranks on two CPUs, each thread-sleeping ~3 s/s; c given 1.5x the batch from
    t = 1060 gets only 1.14x its CPU (0.49 -> 0.56 cores) while its peers' falls 5% (0.49 -> 0.465), and the others
    wait 0.12 s/s more than it — under 5% of their wait, and its own CPU under 1.15x its baseline, which alone named
    nobody. Its CPU over its peers' median rose 1.2x: an imbalance. The same job in step, where one rank's CPU share
    wanders 1.1x and the gap 0.12 s/s for a while (seen in balanced runs), names nobody."""
    def job(heavy: str | None, share: float, gap: float):
        def special(n, t):
            if not 1060 <= t < 1120:
                return {"cpu": 0.49e9, "wait": 3.0e9}
            if n == heavy:
                return {"cpu": 0.49e9 * share ** 0.5 * 1.04, "wait": 3.0e9}
            return {"cpu": 0.49e9 / share ** 0.5 * 1.04, "wait": 3.0e9 + gap * 1e9}
        return special
    w = StragglerWatch()
    ev = run(w, 200, job("c", 1.21, 0.12))
    assert named(ev) == [("c", "imbalance"), ("c", "imbalance_end")], ev
    assert "1.2" in ev[0][4]["reason"] and w.named == 0, ev[0][4]["reason"]
    assert ev[0][0] - 1060 <= 10, ev[0][0]   # the stretch target: within 10 s (read over the newest slice)
    w = StragglerWatch()
    assert named(run(w, 200, job("c", 1.10, 0.12))) == []


def test_the_node_that_took_the_cpu_a_straggler_let_go_is_no_imbalance():
    """b throttled from t = 1060 to 1120 (named); meanwhile a, on the same machine, gets the CPU b cannot use (0.9 ->
    1.1 cores) and waits less than c — 'waited for' with its CPU up, which alone would read as more work. While
    another node is the straggler, that is not the job's imbalance: only b is named (a DDP run here named a)."""
    w = StragglerWatch()

    def fault(n, t):
        if not 1060 <= t < 1120:
            return {}
        return {"b": {"throttled": 0.6e9, "limit": 0.25, "wait": 0.05e9}, "a": {"cpu": 1.1e9, "wait": 0.2e9},
                "c": {"wait": 0.7e9}}[n]
    ev = run(w, 200, fault)
    assert named(ev) == [("b", "straggler"), ("b", "straggler_end")], ev


def test_a_null_figure_is_no_figure_and_stops_nothing():
    """A valid frame may hold null where its host cannot tell a figure (sched's runq_lat_ns here): the watch reads
    it as absent — found by the hostile-bodies property test, where it raised inside the stragglers consumer."""
    from jobprobe.cluster.causes import figures
    from jobprobe.cluster.stragglers import StragglerWatch
    probes = {"cgroup": {"cpu_user_ns": 4 * 10 ** 8, "cpu_system_ns": None}, "sched": {"runq_lat_ns": None,
              "offcpu_lock_ns": 0, "offcpu_wait_ns": 5}, "gpu": {"gpus": [{"util_gpu_pct": None},
                                                                      {"util_gpu_pct": 50, "sm_clock_mhz": None}]}}
    assert figures(probes) == {"cpu_ns": 4 * 10 ** 8, "wait_ns": 5, "gpu_dt": 1.0, "gpu_util": 50.0, "gpu_clock": 0.0,
                               "gpu_throttled": 0.0}
    frame = {"kind": "sample", "node": "n1", "job": "j", "run": "r", "seq": 1, "t": 1.7e9, "dt": 1.0,
             "probes": probes}
    assert StragglerWatch().feed([frame]) == []


def test_a_stall_at_the_memory_limit_says_so():
    """A node stalled on I/O while its group sits at its memory limit (its page cache squeezed: its data read again
    from the disk) is named for the I/O stall, and the reason says it is at its limit; a node under its limit with
    the same stall is not said to be."""
    def win(full: bool) -> Window:
        cg = {"cpu_user_ns": 5e8, "cpu_system_ns": 0, "mem_bytes": (250 if full else 100) << 20,
              "mem_limit_bytes": 256 << 20}
        return Window(10.0, {k: 10 * v for k, v in figures({"cgroup": cg, "pressure": {"io_some_ns": 3e8}}).items()})
    calm = Window(10.0, {"io_stall_ns": 0.0, "cpu_ns": 5e9})
    for full in (True, False):
        (c,) = causes(win(full), [calm, calm])
        assert c.name == "io_pressure" and ("at its memory limit 100% of the time" in c.text) == full, c.text



def replay_script_and_store(tmp_path: Path):
    """scripts/straggler_replay.py as a module, and a store holding a job whose node b is CPU-throttled for 60 s from
    t = 1060 (its peers waiting for it): (the module, the frames)."""
    import importlib.util

    from jobprobe.cluster.store import Store
    spec = importlib.util.spec_from_file_location("straggler_replay", ROOT / "scripts" / "straggler_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    frames = [frame(n, t, throttled=0.6e9 if n == "b" and 1060 <= t < 1120 else 0, limit=0.25 if n == "b" else None,
                    wait=(0.05e9 if n == "b" else 0.7e9) if 1060 <= t < 1120 else 0.3e9)
              for t in range(1000, 1200) for n in ("a", "b", "c")]
    store = Store(tmp_path / "store.db")
    store.add(frames)
    store.close()
    return mod, frames


def test_the_replay_script_decides_as_the_controller_did_and_says_why(tmp_path):
    """scripts/straggler_replay.py on a store holding a throttled node's frames: the same events as the detector fed
    the frames directly, and a line per comparison of the node with its gap, its bound and its verdict."""
    import io

    mod, frames = replay_script_and_store(tmp_path)
    w = StragglerWatch()
    direct = [e[:3] for f in frames for e in w.feed([f])]
    out = io.StringIO()
    replayed = [e[:3] for e in mod.replay(str(tmp_path / "store.db"), "j", node="b", since=1000.0, out=out)]
    assert replayed == direct == [("b", "j", "straggler"), ("b", "j", "straggler_end")], (replayed, direct)
    lines = out.getvalue().splitlines()
    assert any(" b gap " in ln and "verdict straggler" in ln and "causes ['cpu_throttled']" in ln for ln in lines)
    assert any("EVENT straggler b:" in ln for ln in lines) and not any(" a gap " in ln for ln in lines)


def test_the_replay_scores_a_bench_runs_trials_and_weighs_a_setting(tmp_path):
    """scripts/straggler_replay.py --bench: the replay's events scored trial by trial as the bench scores a run (the
    throttled node named, its delay from the fault's time, nothing false; a balanced trial after it with nobody
    named) — and a shorter hold (`--set OPEN_S=4`) names it 3 s sooner, which is how a setting is weighed."""
    import io

    mod, _ = replay_script_and_store(tmp_path)
    trials = [{"fault": "cpu", "rank": 1, "node": "b", "t_fault": 1059.5, "t_clear": 1119.5},
              {"fault": "balanced", "rank": 0, "node": "a", "t_fault": 1150.0, "t_clear": 1180.0}]
    scored = {}
    for hold in (7.0, 4.0):
        events = mod.replay(str(tmp_path / "store.db"), "j", out=io.StringIO(), open_s=hold)
        scored[hold] = mod.score(events, trials)
    res = scored[7.0]
    assert res["rows"]["cpu"]["detected"] == 1 and res["rows"]["cpu"]["right_cause"] == 1, res
    assert res["rows"]["balanced"]["false_names"] == 0 and res["precision"] == 1.0 and res["recall"] == 1.0, res
    late, soon = (scored[h]["trials"][0]["latency_s"] for h in (7.0, 4.0))
    assert 7.0 <= late <= 12.0 and abs((late - soon) - 3.0) <= 1.0, (late, soon)
    from jobprobe.cluster import stragglers
    kept = stragglers.OPEN_S
    try:
        assert mod.settings(["OPEN_S=6"]) == {"open_s": 6.0} and stragglers.OPEN_S == 6.0
    finally:
        stragglers.OPEN_S = kept


def test_the_nodes_that_waited_for_the_one_named_are_said_when_each_waits_about_as_it_usually_does():
    """A CI run named a rank given more work (its peers waiting 0.07 s/s more than its own over the slice) and said
    nobody waited for it: node a always waits most (its usual gap -0.2 s/s), and while b was slow both a and c
    waited a little less than their usual against their peers (gaps +0.06, +0.03, neither waiting by the bound).
    Who waited is then those that waited longer than b."""
    import numpy as np

    from jobprobe.cluster.waits import Waits

    class Table:        # the three nodes' wait figures (s/s) and each one's peers' median: what Waits reads
        x = np.array([0.50, 0.30, 0.42])
        starts, seg = np.array([0]), np.zeros(3, dtype=int)

        def col(self, k):
            return self.x if k == "wait" else np.full(3, np.nan)

        def order(self, k):
            med = np.array([(self.x.sum() - v) / 2 for v in self.x])
            return med, med, np.full(3, 2)
    w = Waits(Table(), np.array([-0.2, 0.09, -0.05])).part(0, ["a", "b", "c"], {"a": 0, "b": 1, "c": 2})
    assert w.gap_of("b") > 0.05 and not w.waiting("a") and not w.waiting("c")
    assert w.waited_by("b") == ["a", "c"]
    # a peer with its own gap below 0 (waiting more than usual against its peers): that one, as before
    w = Waits(Table(), np.array([-0.2, 0.09, 0.0])).part(0, ["a", "b", "c"], {"a": 0, "b": 1, "c": 2})
    assert w.waited_by("b") == ["c"]


@pytest.mark.parametrize("how, said", [
    ({"cpu": 0.0, "wait": 0.0, "stopped": 1.0e9}, "paused: its threads were stopped"),       # SIGSTOP
    ({"cpu": 0.05e9, "wait": 0.05e9, "dstate": 0.9e9}, "blocked in the kernel"),           # a hung file system
    ({"cpu": 0.3e9, "wait": 0.05e9}, "no figure of its node moved"),                        # a GPU, a link, a bug
])
def test_a_node_everyone_waits_for_with_no_cause_is_named_unknown_with_what_its_threads_did(how, said):
    """Node b does less than usual while the others wait for it, and no figure of its node moved (its threads
    stopped; in uninterruptible sleep; or nothing a probe sees): named all the same, cause `unknown`, after the
    longer hold, and cleared once the others stop waiting for it. Seen failing before the verdict: never named."""
    w = StragglerWatch()
    stall = lambda n, t: (how if n == "b" else {"wait": 0.9e9}) if 1060 <= t < 1120 else {}
    ev = run(w, 200, stall, noisy=True)
    assert [(e[1], e[3]) for e in ev] == [("b", "straggler"), ("b", "straggler_end")], ev
    t_open, _, _, _, body = ev[0]
    assert 1060 + UNKNOWN_OPEN_S <= t_open <= 1060 + 12, t_open
    assert body["causes"] == ["unknown"] and said in body["reason"] and "cause unknown" in body["reason"], body
    assert body["waited_by"] == ["a", "c"] and body["evidence"]["unknown"]["value"] >= 0.3
    assert 1120 < ev[1][0] <= 1120 + 13, ev[1]
    assert w.open() == []


def test_a_node_waited_for_that_does_more_is_imbalance_never_unknown():
    """The job's own imbalance (b given more work: its CPU up) is not a node fault of unknown cause."""
    w = StragglerWatch()
    more = lambda n, t: ({"cpu": 1.35e9, "wait": 0.05e9} if n == "b" else {"wait": 0.7e9}) if 1060 <= t < 1130 \
        else {}
    ev = run(w, 200, more)
    assert all(e[4].get("causes") != ["unknown"] for e in ev) and [e[3] for e in ev if e[3] == "straggler"] == [], ev


def test_two_nodes_equally_slow_are_both_named_each_with_its_cause():
    """Four nodes; b CPU-throttled and c paused at once, equally late: the others wait for both, each is named with
    its own cause (cpu_throttled; unknown, paused), and nobody else."""
    w = StragglerWatch()

    def two(n, t):
        if not 1060 <= t < 1120:
            return {}
        return {"b": {"throttled": 0.6e9, "limit": 0.25, "wait": 0.05e9, "cpu": 0.25e9},
                "c": {"cpu": 0.0, "wait": 0.0, "stopped": 1.0e9}}.get(n, {"wait": 0.9e9})
    ev = run(w, 200, two, nodes=("a", "b", "c", "d"))
    opened = {e[1]: e[4] for e in ev if e[3] == "straggler"}
    assert sorted(opened) == ["b", "c"] and sorted(e[1] for e in ev if e[3] == "straggler_end") == ["b", "c"], ev
    assert opened["b"]["causes"] == ["cpu_throttled"] and opened["c"]["causes"] == ["unknown"], opened
    assert "paused" in opened["c"]["reason"] and set(opened["b"]["waited_by"]) >= {"a", "d"}


def test_a_node_slowed_but_not_the_bottleneck_is_not_named():
    """b throttled hard, c a little (its limit hit 20% of the time) but still waiting for b: only b is named."""
    w = StragglerWatch()

    def one_and_a_half(n, t):
        if not 1060 <= t < 1120:
            return {}
        return {"b": {"throttled": 0.6e9, "limit": 0.25, "wait": 0.05e9, "cpu": 0.25e9},
                "c": {"throttled": 0.2e9, "limit": 0.8, "wait": 0.5e9, "cpu": 0.6e9}}.get(n, {"wait": 0.9e9})
    ev = run(w, 200, one_and_a_half, nodes=("a", "b", "c", "d"))
    assert [(e[1], e[3]) for e in ev] == [("b", "straggler"), ("b", "straggler_end")], ev
