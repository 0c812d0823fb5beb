#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install jobprobe on a node or on the controller's host, from its wheel, with only what that role runs:
#   node        bcc and the kernel headers from the distribution (python3-bpfcc; headers as scripts/headers.sh finds
#               them), a virtual environment holding the wheel and what the agent imports, the agent's systemd
#               unit, the SLURM prolog/epilog and the Kubernetes manifest under PREFIX/share
#   controller  nats-server from the distribution, the wheel with its [controller] extra, the controller's unit
# Never the demo or test stack (PyTorch, pytest, Chromium, Prometheus, SLURM). Idempotent: a second run with the
# same wheel changes nothing; a new wheel replaces the old one. Settings files are written once, never overwritten.
#
# Usage: scripts/install.sh node|controller [--wheel FILE] [--prefix DIR] [--bin-dir DIR] [--unit-dir DIR]
#                                            [--etc-dir DIR] [--no-system] [--no-start]
#   --wheel FILE   the jobprobe wheel (`make dist` writes dist/jobprobe-*.whl); default: built from this checkout
#   --prefix DIR   the virtual environment (default /opt/jobprobe); its python is the distribution's /usr/bin/python3,
#                  which sees bcc through a link to /usr/lib/python3/dist-packages/bcc (bcc's Python module only)
#   --bin-dir DIR  where the `jobprobe` command is linked (default /usr/local/bin)
#   --unit-dir DIR systemd units (default /etc/systemd/system)
#   --etc-dir DIR  settings (default /etc/jobprobe): agent.toml (node), controller.env (controller)
#   --no-system    install no distribution package (they are there already, or the site installs them)
#   --no-start     do not enable and start the service (it is started only where systemd runs, with the default dirs)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
log() { printf 'install: %s\n' "$*" >&2; }
die() { printf 'install: %s\n' "$*" >&2; exit 2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

role=${1:-}
case "$role" in
  node|controller) shift ;;
  *) die "usage: scripts/install.sh node|controller [options] (see the file)" ;;
esac
wheel="" prefix=/opt/jobprobe bin_dir=/usr/local/bin unit_dir=/etc/systemd/system etc_dir=/etc/jobprobe
system=1 start=1
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel) wheel=$(readlink -f "${2:?--wheel FILE}"); shift 2 ;;
    --prefix) prefix=${2:?--prefix DIR}; shift 2 ;;
    --bin-dir) bin_dir=${2:?--bin-dir DIR}; shift 2 ;;
    --unit-dir) unit_dir=${2:?--unit-dir DIR}; shift 2 ;;
    --etc-dir) etc_dir=${2:?--etc-dir DIR}; shift 2 ;;
    --no-system) system=0; shift ;;
    --no-start) start=0; shift ;;
    *) die "unknown option $1 (see scripts/install.sh)" ;;
  esac
done
[ -z "$wheel" ] || [ -f "$wheel" ] || die "no wheel at $wheel"
[ "$(id -u)" = 0 ] || [ "$system" = 0 ] ||
  die "run it as root: it installs distribution packages (--no-system skips them)"
{ mkdir -p "$prefix" 2>/dev/null && [ -w "$prefix" ]; } || die "cannot write $prefix (run it as root, or give --prefix)"
SECONDS=0

# ---- distribution packages -----------------------------------------------------------------------------------
. "$here/scripts/headers.sh"
if [ "$system" = 1 ]; then
  if [ "$role" = node ]; then
    apt_install python3-bpfcc python3-venv ca-certificates
    kernel_headers unpack
  else
    apt_install python3-venv ca-certificates nats-server
  fi
fi
py=/usr/bin/python3                      # the distribution's: bcc's Python module is installed for it
[ -x "$py" ] || die "no $py (python3 from the distribution)"

# ---- the virtual environment and the wheel ---------------------------------------------------------------------
if [ ! -x "$prefix/bin/python" ]; then
  log "creating the virtual environment $prefix"
  "$py" -m venv "$prefix"
fi
[ "$role" = controller ] || link_bcc "$prefix/bin/python" || exit 2
pip=("$prefix/bin/python" -m pip -q --disable-pip-version-check)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -z "$wheel" ]; then
  log "building the wheel from $here"
  "${pip[@]}" wheel --no-deps -w "$tmp" "$here" >/dev/null
  wheel=$(ls "$tmp"/jobprobe-*.whl)
fi
extra=""; [ "$role" = controller ] && extra="[controller]"
want="$(sha256sum "$wheel" | cut -d' ' -f1) $role"
stamp=$prefix/.jobprobe-wheel
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "pip install $(basename "$wheel")$extra"
  "${pip[@]}" install "$wheel$extra"
  "${pip[@]}" install --no-deps --force-reinstall "$wheel"      # the same version number, newer contents
  echo "$want" > "$stamp"
fi

# ---- the files a site installs beside the package ---------------------------------------------------------------
"$prefix/bin/python" - "$prefix/share" <<'EOF'
import filecmp, os, shutil, sys
from jobprobe.deploy import files
for rel, src in files().items():
    dst = os.path.join(sys.argv[1], rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if not os.path.exists(dst) or not filecmp.cmp(src, dst, shallow=False):
        shutil.copyfile(src, dst)
    os.chmod(dst, 0o755 if rel.startswith("slurm/") else 0o644)
EOF
mkdir -p "$bin_dir"
[ "$(readlink "$bin_dir/jobprobe" 2>/dev/null)" = "$prefix/bin/jobprobe" ] ||
  ln -sfn "$prefix/bin/jobprobe" "$bin_dir/jobprobe"
unit=jobprobe-agent.service; [ "$role" = controller ] && unit=jobprobe-controller.service
mkdir -p "$unit_dir" "$etc_dir"
sed "s|/usr/local/bin/jobprobe|$bin_dir/jobprobe|g" "$prefix/share/systemd/$unit" > "$tmp/$unit"
cmp -s "$tmp/$unit" "$unit_dir/$unit" || install -m 0644 "$tmp/$unit" "$unit_dir/$unit"
conf=agent.toml; [ "$role" = controller ] && conf=controller.env
[ -e "$etc_dir/$conf" ] || install -m 0644 "$prefix/share/systemd/$conf" "$etc_dir/$conf"

# ---- the service ------------------------------------------------------------------------------------------------
if [ "$start" = 1 ] && [ "$unit_dir" = /etc/systemd/system ] && [ -d /run/systemd/system ]; then
  if [ "$role" = controller ] && systemctl is-enabled -q nats-server.service 2>/dev/null; then
    log "the distribution's nats-server.service stopped and disabled: the controller runs its own nats-server"
    systemctl disable --now -q nats-server.service
  fi
  systemctl daemon-reload
  systemctl enable -q "$unit"
  systemctl restart "$unit"
  log "$unit enabled and (re)started"
elif [ "$start" = 1 ]; then
  log "systemd does not run here (or --unit-dir is not /etc/systemd/system): start it with systemctl enable --now $unit"
fi
log "$("$prefix/bin/jobprobe" --version) ($role) in $prefix: $(du -sm "$prefix" | cut -f1) MB, $SECONDS s"
