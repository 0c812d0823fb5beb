#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `make demo`: run the CPU reference training job (~20 s) under jobprobe, a line per second, then decode the file;
# the node agent with two jobs and a controller; last, a DDP job across three namespace nodes with one rank slowed,
# ending on the straggler the controller names.
# Usage: scripts/demo.sh [run|agent|stragglers]…   (default: all three; tests/test_demo.py runs `agent`)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out
rm -f out/demo.mpk
steps=${DEMO_STEPS:-45}
sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
parts=" ${*:-run agent stragglers} "
part() { [[ "$parts" == *" $1 "* ]]; }
if part run; then
echo "== jobprobe run --out out/demo.mpk --stdout -- python scripts/train_cpu.py --steps $steps"
$sudo_ .venv/bin/jobprobe run --out out/demo.mpk --stdout -- .venv/bin/python scripts/train_cpu.py --steps "$steps"
echo
echo "== jobprobe read out/demo.mpk --format summary (per field over the run)"
.venv/bin/jobprobe read out/demo.mpk --format summary
echo "== jobprobe summary out/demo.mpk (where the job's wall time went)"
.venv/bin/jobprobe summary out/demo.mpk
echo
echo "out/demo.mpk: $(stat -c %s out/demo.mpk) bytes; decode it with: .venv/bin/jobprobe read out/demo.mpk"
fi

if part agent; then

echo
echo "== the node agent: two jobs attached at run time, one set of kernel programs for both;"
echo "   frames also sent over NATS JetStream to a controller (it starts its own nats-server) and its store"
cg2=$(.venv/bin/python -c 'from jobprobe.kernel.host import find_cgroup2_mount; print(find_cgroup2_mount())')
sock=out/agent.sock
nats=nats://127.0.0.1:${DEMO_NATS_PORT:-14222}
rm -rf out/agent out/jobs.json out/controller out/spool
.venv/bin/jobprobe controller --data out/controller --listen "${nats#nats://}" 2> out/controller.log &
controller=$!
agent=""
trap '[ -z "$agent" ] || $sudo_ kill $agent 2>/dev/null || true; kill $controller 2>/dev/null || true' EXIT
for _ in $(seq 300); do grep -q consuming out/controller.log 2>/dev/null && break; sleep 0.1; done
# the controller's server lets in only the nodes it enrolled: this node's key (the last line printed)
creds=$(.venv/bin/jobprobe controller enroll demo-node --data out/controller | tail -n 1)
$sudo_ .venv/bin/jobprobe agent --socket "$sock" --state out/jobs.json --out out/agent --interval 1 \
    --node demo-node --send "$nats" --nats-creds "$creds" --spool out/spool &
agent=$!
for _ in $(seq 100); do .venv/bin/jobprobe status --socket "$sock" >/dev/null 2>&1 && break; sleep 0.1; done
pids=()
for j in demo-a demo-b; do
  $sudo_ mkdir -p "$cg2/jobprobe-demo/$j"
  $sudo_ .venv/bin/jobprobe attach --socket "$sock" --cgroup "$cg2/jobprobe-demo/$j" --job "$j" \
      --label user=demo --label account=reference
  # demo-b crashes on purpose after its last step (exit 3): its end and its lost work are in its summary
  code=0; [ "$j" = demo-b ] && code=3
  $sudo_ sh -c "echo \$\$ > '$cg2/jobprobe-demo/$j/cgroup.procs'; exec .venv/bin/python scripts/train_cpu.py --steps 8 --exit-code $code" \
    > /dev/null 2>&1 &
  pids+=($!)
done
sleep 3
$sudo_ .venv/bin/jobprobe status --socket "$sock"
wait "${pids[@]}" || true
sleep 4                                   # each job is detached by itself after its last frame, and the
                                          # controller sees it end (3 intervals without its samples): its summary
$sudo_ .venv/bin/jobprobe status --socket "$sock"
$sudo_ kill -TERM $agent; wait $agent || true
sleep 1
echo "== jobprobe controller stats: every node's freshness at the controller"
.venv/bin/jobprobe controller stats --data out/controller
echo "== jobprobe query: what the controller stored"
.venv/bin/jobprobe query --store out/controller/store.db \
    --sql "SELECT job, kind, COUNT(*) AS frames, MIN(seq) AS first, MAX(seq) AS last FROM frames GROUP BY 1, 2"
kill -TERM $controller; wait $controller || true
trap - EXIT
for j in demo-a demo-b; do $sudo_ rmdir "$cg2/jobprobe-demo/$j" 2>/dev/null || true; done
$sudo_ rmdir "$cg2/jobprobe-demo" 2>/dev/null || true
for j in demo-a demo-b; do
  echo "== out/agent/$j.mpk: sched and perf over the run"
  .venv/bin/jobprobe read "out/agent/$j.mpk" --format summary |
    grep -E "^field|perf.task_clock_ns|sched.offcpu_ns|sched.runq_lat_ns" || true
done
echo "== jobprobe report: one page per job, to open in a browser"
.venv/bin/jobprobe report --store out/controller/store.db --job demo-a -o out/demo-a-report.html
echo "   open out/demo-a-report.html"
echo "== jobprobe summary --store: where demo-a's time went"
.venv/bin/jobprobe summary --store out/controller/store.db --job demo-a
echo "== jobprobe summary --store: demo-b crashed (exit 3); its work since its last checkpoint is lost"
.venv/bin/jobprobe summary --store out/controller/store.db --job demo-b | head -n 3
echo "== jobprobe jobs: the jobs that ended, a row each (owner, wall, how each ended, goodput, largest badput)"
.venv/bin/jobprobe jobs --store out/controller/store.db --since 1h
fi

part stragglers || exit 0
echo
echo "== a straggler: PyTorch DDP on three namespace nodes (an agent each) → NATS → controller; one rank slowed"
rm -rf out/stragglers
$sudo_ .venv/bin/python -m jobprobe.bench.ddp out/stragglers
