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
    if not Host().is_root:
        raise BadInput("not root: the benchmarks create cgroups and run jobprobe's probes")
    run = RUNNERS.get(args.bench)
    if run is not None:
        res, module, rc = run(args)
        _emit(args, res, module)
        return rc
    if not args.command:
        raise BadInput(f"nothing to run: jobprobe bench {args.bench} [options] -- CMD ARGS...")
    if args.bench == "peers":
        from jobprobe.bench import peers
        _emit(args, peers.run_peers(args.command, args.interval), peers)   # its own mkdtemp scratch directory
        return 0
    from jobprobe.bench.overhead import OverheadBench, write_outputs
    for c in args.config or []:
        _check_config(c)
    bench = OverheadBench(args.command, args.config or ["std"], interval=args.interval, max_runs=args.max_runs,
                          max_minutes=args.max_minutes, min_pairs=args.min_pairs, tol=args.tolerance_pp / 100,
                          warmup=args.warmup, seed=args.seed,
                          precision=args.precision_pp / 100 if args.precision_pp else None)
    print(write_outputs(bench.run(), args.json, args.markdown))
    return 0


def _emit(args, res: dict, module) -> None:
    """A bench's result: as JSON to --json, and its markdown table on stdout."""
    if args.json:
        from pathlib import Path
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(module.markdown(res))


def _events(args):
    from jobprobe.bench import events
    return events.bench_events(args.probe, args.rounds, args.n, not args.no_peer, args.seed,
                               progress=sys.stderr), events, 0


def _agent(args):
    from jobprobe.bench import agent as agent_bench
    try:
        counts = tuple(int(x) for x in args.jobs.split(","))
    except ValueError:
        raise BadInput(f"--jobs: numbers separated by commas, got {args.jobs!r}") from None
    if not counts or min(counts) < 1 or max(counts) > 64:
        raise BadInput("--jobs: each between 1 and 64 (the node's job slots)")
    return agent_bench.bench_agent(counts, args.n, args.idle_seconds, args.cycles, args.probes, not args.no_peer,
                                   progress=sys.stderr, nats=args.nats), agent_bench, 0


def _store(args):
    from jobprobe.bench import storebench
    if args.nodes < 8 or args.hours < 1:
        raise BadInput("bench store: at least 8 nodes (one job) and 1 hour")
    return storebench.bench_store(args.nodes, args.hours, args.workdir, progress=sys.stderr), storebench, 0


def _controller(args):
    from jobprobe.bench import controller, failover
    if args.partitions > 1:         # the same face: a dict, its markdown
        return failover.bench_failover(args.nodes, args.seconds, args.partitions, progress=sys.stderr), failover, 0
    return controller.bench_controller(args.nodes, args.seconds, args.burst_frames, progress=sys.stderr), \
        controller, 0


def _accuracy(args):
    from jobprobe.bench import accuracy
    res = accuracy.bench_accuracy(args.runs, args.load, args.interval, args.only, progress=sys.stderr)
    return res, accuracy, 0 if res["pass"] else 1


def _stragglers(args):
    from jobprobe.bench import stragglers
    only = [f for x in args.only or [] for f in x.split(",") if f]
    if args.runs < 1:
        raise BadInput("--runs: at least 1")
    return stragglers.bench_stragglers(args.runs, only, args.seed, progress=sys.stderr), stragglers, 0


def _idle(args):
    from jobprobe.bench import idle
    try:
        counts = tuple(int(x) for x in args.jobs.split(","))
    except ValueError:
        raise BadInput(f"--jobs: numbers separated by commas, got {args.jobs!r}") from None
    if not counts or min(counts) < 1 or max(counts) > 1024 or not 0 <= args.busy <= 256:
        raise BadInput("--jobs: each between 1 and 1024; --busy: 0 to 256")
    if args.runs < 1 or args.seconds <= 0:
        raise BadInput("--runs: at least 1; --seconds: more than 0")
    return idle.bench_idle(counts, args.busy, args.runs, args.seconds, args.settle, args.probes,
                           progress=sys.stderr), idle, 0


# the benchmarks that run no command of the user's: each returns (its result, its module, the exit code)
RUNNERS = {"events": _events, "agent": _agent, "store": _store, "controller": _controller, "accuracy": _accuracy,
           "stragglers": _stragglers, "idle": _idle}


def _check_config(config: str) -> None:
    import tempfile
    from pathlib import Path

    from jobprobe.bench.overhead import config_options, config_probes
    from jobprobe.node.registry import all_probes, parse_probes
    with tempfile.TemporaryDirectory() as d:
        base, _ = config_options(config, Path(d))       # raises BadInput naming an unknown @option
    parse_probes(config_probes(base), all_probes())   # raises BadInput naming an unknown probe

