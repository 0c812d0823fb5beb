#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `make bench`: reproduce docs/PERFORMANCE.md's tables on this machine.
#   BENCH_MINUTES  budget of the overhead kit (default 40)   BENCH_STEPS  reference job size (default 40)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/bench
minutes=${BENCH_MINUTES:-40}
steps=${BENCH_STEPS:-40}
job=(.venv/bin/python scripts/train_cpu.py --steps "$steps")
jp=.venv/bin/jobprobe

echo "== collector cost beside node_exporter (same job, 1 s interval)"
$jp bench peers --json out/bench/peers.json -- "${job[@]}" | tee out/bench/peers.md

echo "== per-event cost of the eBPF probes (on vs off, interleaved), with bcc's runqlat as a peer"
$jp bench events --json out/bench/events.json | tee out/bench/events.md

echo "== the node agent with 1, 16, 64 jobs: ns per event beside runqlat, idle cost, attach latency, leaks"
$jp bench agent --json out/bench/agent.json | tee out/bench/agent.md

echo "== the agent sending to NATS (a local nats-server and controller): idle cost with the sink"
$jp bench agent --jobs 64 --idle-seconds 30 --cycles 20 --no-peer --nats --json out/bench/agent-nats.json \
    | tee out/bench/agent-nats.md

echo "== one controller: 2000 simulated nodes, its ceiling, a node's bytes on the wire"
$jp bench controller --nodes 2000 --json out/bench/controller.json | tee out/bench/controller.md

echo "== accuracy: each figure against the workload's own count, 20 runs per case beside a CPU and O_DIRECT load"
$jp bench accuracy --load cpu+io --json out/bench/accuracy.json | tee out/bench/accuracy.md

echo "== the SLURM prolog and epilog: how long they hold a job up"
.venv/bin/python scripts/prolog_time.py 30 | tee out/bench/prolog.md

echo "== job slowdown per config: paired runs, up to $minutes minutes"
$jp bench overhead --config std --config std-perf --config std-sched --config cgroup,self \
    --max-minutes "$minutes" --max-runs 400 --json out/bench/overhead.json --markdown out/bench/overhead.md \
    -- "${job[@]}"

echo "== stragglers: each fault 5 times at a random time on a random rank of a real 3-rank DDP job"
$jp bench stragglers --runs 5 --json out/bench/stragglers.json | tee out/bench/stragglers.md
