# SPDX-License-Identifier: Apache-2.0
"""bench: what the probes cost a job and what jobprobe's figures are worth. overhead (paired runs of -- CMD without
and with each probe config), peers (beside node_exporter), events (ns per kernel event), agent (the node agent with
many jobs), controller (against simulated nodes), accuracy (figures beside the workload's own counts), stragglers
(the detector against a fault matrix on a real DDP job). The
benchmarks, and what they drive, are imported only when one runs."""
from __future__ import annotations

import json
import sys

from jobprobe.core.errors import BadInput
from jobprobe.kernel.host import Host


def cmd_bench(args) -> int:
    from jobprobe.bench.overhead import OverheadBench, write_outputs
    command = args.command
    if not Host().is_root:
        raise BadInput("not root: the benchmarks create cgroups and run jobprobe's probes")
    if args.bench == "events":
        from pathlib import Path

        from jobprobe.bench import events
        res = events.bench_events(args.probe, args.rounds, args.n, not args.no_peer, args.seed, progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(events.markdown(res))
        return 0
    if args.bench == "agent":
        from pathlib import Path

        from jobprobe.bench import agent as agent_bench
        try:
            counts = tuple(int(x) for x in args.jobs.split(","))
        except ValueError:
            raise BadInput(f"--jobs: numbers separated by commas, got {args.jobs!r}") from None
        if not counts or min(counts) < 1 or max(counts) > 64:
            raise BadInput("--jobs: each between 1 and 64 (the node's job slots)")
        res = agent_bench.bench_agent(counts, args.n, args.idle_seconds, args.cycles, args.probes, not args.no_peer,
                                      progress=sys.stderr, nats=args.nats)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(agent_bench.markdown(res))
        return 0
    if args.bench == "store":
        from pathlib import Path

        from jobprobe.bench import storebench
        if args.nodes < 8 or args.hours < 1:
            raise BadInput("bench store: at least 8 nodes (one job) and 1 hour")
        res = storebench.bench_store(args.nodes, args.hours, args.workdir, progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(storebench.markdown(res))
        return 0
    if args.bench == "controller":
        from pathlib import Path

        from jobprobe.bench import controller, failover
        if args.partitions > 1:         # the same face: a dict, its markdown
            ctl_bench, res = failover, failover.bench_failover(args.nodes, args.seconds, args.partitions,
                                                               progress=sys.stderr)
        else:
            ctl_bench, res = controller, controller.bench_controller(args.nodes, args.seconds, args.burst_frames,
                                                                     progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(ctl_bench.markdown(res))
        return 0
    if args.bench == "accuracy":
        from pathlib import Path

        from jobprobe.bench import accuracy
        res = accuracy.bench_accuracy(args.runs, args.load, args.interval, args.only, progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(accuracy.markdown(res))
        return 0 if res["pass"] else 1
    if args.bench == "stragglers":
        from pathlib import Path

        from jobprobe.bench import stragglers
        only = [f for x in args.only or [] for f in x.split(",") if f]
        if args.runs < 1:
            raise BadInput("--runs: at least 1")
        res = stragglers.bench_stragglers(args.runs, only, args.seed, progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(stragglers.markdown(res))
        return 0
    if not command:
        raise BadInput(f"nothing to run: jobprobe bench {args.bench} [options] -- CMD ARGS...")
    if args.bench == "peers":
        from pathlib import Path

        from jobprobe.bench import peers
        res = peers.run_peers(command, args.interval)      # its own mkdtemp scratch directory
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(peers.markdown(res))
        return 0
    for c in args.config or []:
        _check_config(c)
    bench = OverheadBench(command, args.config or ["std"], interval=args.interval, max_runs=args.max_runs,
                          max_minutes=args.max_minutes, min_pairs=args.min_pairs, tol=args.tolerance_pp / 100,
                          warmup=args.warmup, seed=args.seed,
                          precision=args.precision_pp / 100 if args.precision_pp else None)
    print(write_outputs(bench.run(), args.json, args.markdown))
    return 0


def _check_config(config: str) -> None:
    import tempfile
    from pathlib import Path

    from jobprobe.bench.overhead import config_options, config_probes
    from jobprobe.node.registry import all_probes, parse_probes
    with tempfile.TemporaryDirectory() as d:
        base, _ = config_options(config, Path(d))       # raises BadInput naming an unknown @option
    parse_probes(config_probes(base), all_probes())   # raises BadInput naming an unknown probe

