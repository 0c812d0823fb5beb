#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up a node (or a developer machine) for jobprobe. Idempotent: run it as often as you like.
#   - Debian packages: bcc (python3-bpfcc, libbpfcc, bpfcc-tools), python3-venv, linux-perf for cross-checks,
#     SLURM and munge (the tests start a one-node cluster), prometheus-node-exporter (the peer in
#     `jobprobe bench peers`), nats-server, prometheus and victoria-metrics (the tests start them on loopback),
#     chromium (headless: the tests open `jobprobe report`'s page in it), iptables (packet loss on a rank's link in
#     the straggler tests), mmdebstrap (the tests build the DaemonSet image's root filesystem: tests/test_image.py)
#   - kernel headers for the running kernel, or the nearest packaged ones linked under /lib/modules/$(uname -r)
#   - a .venv in which `import bcc` works, with jobprobe installed (editable) and the extras named in $EXTRAS
# Usage: scripts/setup.sh [--torch] [--bench]   (--torch also installs PyTorch CPU for the reference job, best effort;
#                                              --bench is accepted for `make bench`: it needs nothing more today)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
want_torch=0
for a in "$@"; do [ "$a" = "--torch" ] && want_torch=1; done
EXTRAS=${EXTRAS:-test}
PY=${PYTHON:-python3}
log() { printf 'setup: %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# ---- Debian packages and kernel headers --------------------------------------------------------------
. "$here/scripts/headers.sh"
apt_install python3-bpfcc libbpfcc bpfcc-tools python3-venv linux-perf iproute2 iptables slurm-wlm slurm-client munge \
  prometheus-node-exporter fio stress-ng iperf3 nats-server prometheus victoria-metrics chromium mmdebstrap
kernel_headers

# ---- tracefs / debugfs (bcc attaches tracepoints through them) -----------------------------------
if [ "$(id -u)" = 0 ]; then
  [ -e /sys/kernel/tracing/events ] || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
  [ -e /sys/kernel/debug/tracing ] || mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
fi

# ---- virtual environment -------------------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
link_bcc .venv/bin/python
stamp=.venv/.jobprobe-installed
TORCH=torch==2.13.0
pipi() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
has_torch() { .venv/bin/python -c 'import torch' 2>/dev/null; }
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  torch_bg="" deps=()
  if [ "$want_torch" = 1 ] && ! has_torch; then
    # PyTorch's own files (~1 GB to unpack and compile) on the other CPU while pip installs the rest, its
    # dependencies with them (torch 2.13.0's Requires-Dist; the `pip install torch` below adds any it misses);
    # 6-20 s less of a fresh setup (interleaved pairs: 42, 51 s against 49, 71 s)
    pipi --no-deps "$TORCH" > .venv/torch-install.log 2>&1 &
    torch_bg=$!
    deps=(filelock "typing-extensions>=4.10.0" "setuptools>=77.0.3" "sympy>=1.13.3" "networkx>=2.5.1" jinja2
          "fsspec>=0.8.5")
  fi
  log "pip install -e .[$EXTRAS]${torch_bg:+ (and $TORCH beside it)}"
  pipi -e ".[$EXTRAS]" "${deps[@]}" || { [ ${#deps[@]} != 0 ] && pipi -e ".[$EXTRAS]"; }
  [ -z "$torch_bg" ] || wait "$torch_bg" || log "torch: $(tail -n 1 .venv/torch-install.log)"
  touch "$stamp"
fi
if [ "$want_torch" = 1 ] && { [ -n "${torch_bg:-}" ] || ! has_torch; }; then
  [ -n "${torch_bg:-}" ] || log "pip install $TORCH (CPU; the reference job falls back to NumPy if this fails)"
  pipi "$TORCH" || log "torch not installable here"
fi
.venv/bin/python -c 'import bcc' || { log "bcc does not import in .venv"; exit 1; }
# the project's own modules byte-compiled once (pip compiles what it installs, not an editable source tree): where
# the environment sets PYTHONDONTWRITEBYTECODE, as on this kind of machine, every process — an agent, a CLI call, a
# job — would compile them anew at each import (0.16 of 0.3 s of CPU to import the agent, controller and probes)
.venv/bin/python -m compileall -q -j 0 jobprobe probes exporters scripts >/dev/null || log "compileall: some module does not compile"
log "ready: .venv ($(.venv/bin/python --version)), kernel headers at $(readlink -f "/lib/modules/$(uname -r)/build")"
