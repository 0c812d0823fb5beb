#!/usr/bin/env bash
# `make demo`: run the CPU reference training job (~20 s) under jobprobe, a line per second, then decode the file.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out
rm -f out/demo.mpk
steps=${DEMO_STEPS:-45}
sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
echo "== jobprobe run --out out/demo.mpk --stdout -- python scripts/train_cpu.py --steps $steps"
$sudo_ .venv/bin/jobprobe run --out out/demo.mpk --stdout -- .venv/bin/python scripts/train_cpu.py --steps "$steps"
echo
echo "== jobprobe read out/demo.mpk --format summary (per field over the run)"
.venv/bin/jobprobe read out/demo.mpk --format summary
echo
echo "out/demo.mpk: $(stat -c %s out/demo.mpk) bytes; decode it with: .venv/bin/jobprobe read out/demo.mpk"
