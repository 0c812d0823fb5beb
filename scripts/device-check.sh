#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# device-check.sh — prove the GPU side on a real NVIDIA machine in under 5 minutes, and print a compact verdict.
#
#   bash scripts/device-check.sh [OUTDIR]
#
# What it does:
#   1. checks what is there (nvidia-smi, pynvml, torch with CUDA, bcc for the uprobe-based `cuda` probe);
#   2. runs the GPU reference job (scripts/train_gpu.py) under `jobprobe run --probes +gpu[,+cuda]`, while
#      sampling `nvidia-smi --query-gpu` once a second beside it;
#   3. cross-checks jobprobe's per-tick GPU utilization, memory used and power against nvidia-smi's samples, and
#      the job's own SM share (per-process samples) against `nvidia-smi pmon`'s sm column
#      (medians over the run), checks the job was matched to its GPU, and that CUDA launch counts are non-zero
#      and plausible when the `cuda` probe could run;
#   4. a few paired runs of the job without and with standard collection (+gpu): the slowdown;
#   5. prints the verdict and leaves frames, samples and a JSON summary in OUTDIR (default $OUT or ./out/device).
# Needs: Python 3 with torch (CUDA), nvidia-ml-py, msgpack, numpy — what the GPU image has. Installs nothing:
# jobprobe runs from this checkout (PYTHONPATH). Root for the perf/eBPF probes; without them the GPU checks still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/device}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
steps=${DEVICE_STEPS:-400}

echo "== what is here"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || { echo "VERDICT: no nvidia-smi"; exit 1; }
$py -c 'import pynvml, torch, msgpack; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || {
  echo "VERDICT: missing python packages (pynvml, torch, msgpack)"; exit 1; }
probes="+gpu"
if $py -c 'import importlib.util as u; raise SystemExit(u.find_spec("bcc") is None)' 2>/dev/null; then
  probes="+gpu,+cuda"
else
  echo "bcc not importable here: the uprobe-based cuda probe is skipped (install python3-bpfcc to include it)"
fi
$py -m jobprobe.cli probes | grep -E "^(gpu|cuda|perf|sched|cgroup)" || true

echo "== the GPU reference job under jobprobe ($probes), nvidia-smi sampled beside it"
nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used,power.draw --format=csv,noheader,nounits \
  -l 1 > "$out/nvidia-smi.csv" &
smi=$!
nvidia-smi pmon -s u -d 1 > "$out/pmon.txt" 2>/dev/null &      # per-process SM % (the driver's samples)
pmon=$!
$py -m jobprobe.cli run --probes="$probes" --out "$out/frames.mpk" --stdout -- \
  $py scripts/train_gpu.py --steps "$steps" | tail -n 5 | cut -c1-300
kill $smi $pmon 2>/dev/null; wait $smi $pmon 2>/dev/null

echo "== paired runs: the job without and with standard collection (+gpu)"
$py -m jobprobe.cli bench overhead --config std+gpu --max-runs 6 --warmup 1 --json "$out/overhead.json" \
  -- $py scripts/train_gpu.py --steps "$((steps / 2))" || echo "overhead runs failed (needs root for cgroups)"

echo "== verdict"
$py - "$out" <<'PYEOF'
import csv, json, statistics, subprocess, sys
out = sys.argv[1]
frames = [json.loads(l) for l in subprocess.run([sys.executable, "-m", "jobprobe.cli", "read", f"{out}/frames.mpk"],
          capture_output=True, text=True).stdout.splitlines()]
samples = [f for f in frames if f["kind"] == "sample" and f.get("probes", {}).get("gpu", {}).get("gpus")]
smi = [r for r in csv.reader(open(f"{out}/nvidia-smi.csv")) if len(r) == 5]
res, ok = {"samples_with_gpu": len(samples)}, True
def med(xs):
    return statistics.median(xs) if xs else float("nan")
if samples:
    g = [s["probes"]["gpu"]["gpus"][0] for s in samples]
    res["jobprobe"] = {"util_gpu_pct": med([x.get("util_gpu_pct", 0) for x in g]),
                       "mem_used_mib": med([x.get("mem_used_bytes", 0) / 2**20 for x in g]),
                       "power_w": med([x.get("power_mw", 0) / 1000 for x in g]), "rule": g[0].get("rule")}
    res["nvidia_smi"] = {"util_gpu_pct": med([float(r[2]) for r in smi]), "mem_used_mib": med([float(r[3]) for r in smi]),
                         "power_w": med([float(r[4]) for r in smi])}
    for k, tol in (("util_gpu_pct", 15), ("mem_used_mib", 0.15), ("power_w", 0.2)):
        a, b = res["jobprobe"][k], res["nvidia_smi"][k]
        good = abs(a - b) <= (tol if k == "util_gpu_pct" else tol * max(b, 1))
        res[f"{k}_agrees"] = good
        ok &= good
    # the job's own SM share (per-process samples) against nvidia-smi pmon's per-process sm column for its pids
    pm = []
    for line in open(f"{out}/pmon.txt", errors="replace"):
        parts = line.split()
        if len(parts) > 4 and not line.startswith("#") and parts[3].isdigit():
            pm.append(float(parts[3]))                        # gpu pid type sm mem enc dec … : sm
    shares = [x["job_sm_pct"] for x in g if x.get("util_samples")]
    res["job_sm_pct"] = {"jobprobe": med(shares), "nvidia_smi_pmon": med(pm), "source": g[-1].get("util_source")}
    if shares and pm:
        res["job_sm_pct_agrees"] = abs(med(shares) - med(pm)) <= 15
        ok &= res["job_sm_pct_agrees"]
    cuda = [s["probes"].get("cuda", {}) for s in samples]
    launches = sum(c.get("kernel_launches", 0) for c in cuda)
    res["cuda_kernel_launches"] = launches if any(cuda) else "not run"
    if any(cuda):
        ok &= launches > 0
else:
    ok = False
try:
    o = json.load(open(f"{out}/overhead.json"))["configs"]["std+gpu"]
    res["overhead"] = f"{o['slowdown']*100:+.2f}% ({o['lo']*100:+.2f} to {o['hi']*100:+.2f}), {o['pairs']} pairs"
except (OSError, KeyError, ValueError):
    res["overhead"] = "not measured"
json.dump(res, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(res, indent=1))
print("VERDICT:", "PASS" if ok else "FAIL")
PYEOF
