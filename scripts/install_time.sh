#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# How long a node install takes on a fresh machine, and what it leaves on disk (docs/PERFORMANCE.md, "Install"):
# a fresh Debian bookworm root filesystem (mmdebstrap minbase: no Python, no bcc, no headers), this checkout's wheel
# and scripts copied in, then `scripts/install.sh ROLE --wheel …` timed in it (chroot, /proc /sys /dev mounted, the
# host's resolv.conf) — every package fetched from the network as on a new node. Prints the seconds and the sizes:
# the venv, the kernel headers, bcc's packages (with LLVM), and everything else the install added.
# Usage: scripts/install_time.sh [node|controller]     (root; needs mmdebstrap; ~1–2 minutes)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
role=${1:-node}
work=$(mktemp -d /var/tmp/jobprobe-install-time.XXXXXX)
trap 'rm -rf --one-file-system "$work"' EXIT
make -s -C "$here" dist DIST="$work/dist" >/dev/null 2>&1
mmdebstrap --quiet --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr bookworm "$work/root"
mkdir -p "$work/root/src/scripts" "$work/root/src/dist"
cp "$here"/scripts/{install.sh,headers.sh} "$work/root/src/scripts/"
cp "$work"/dist/jobprobe-*.whl "$work/root/src/dist/"
cp /etc/resolv.conf "$work/root/etc/resolv.conf"
# this machine's trust store, as a new machine of its kind has it (the package index may be reached through a proxy
# that signs with a local CA)
mkdir -p "$work/root/etc/ssl/certs" && cp /etc/ssl/certs/ca-certificates.crt "$work/root/etc/ssl/certs/host-ca.crt"
before=$(du -sm --exclude=src "$work/root" | cut -f1)
chroot "$work/root" dpkg-query -W -f '${Package}\n' | sort > "$work/before.txt"
cat > "$work/root/src/run.sh" <<EOF
start=\$(date +%s%N)
bash /src/scripts/install.sh $role --wheel /src/dist/jobprobe-*.whl --no-start || exit 1
echo "install took \$(( (\$(date +%s%N) - start) / 1000000 )) ms"
[ "$role" = node ] || exit 0
jobprobe run --probes sched,net,blockio --duration 1 --stdout json -- sleep 0.5 | python3 -c \
  'import json, sys
print("the installed agent runs its probes:", json.loads(sys.stdin.readline())["probes"])
sys.stdin.read()'
EOF
unshare --mount --propagation private sh -c "mount --bind $work/root $work/root &&
  mount -t proc proc $work/root/proc && mount --rbind /sys $work/root/sys && mount --rbind /dev $work/root/dev &&
  exec chroot $work/root /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root PIP_CERT=/etc/ssl/certs/host-ca.crt bash /src/run.sh" 2>&1 | grep -v '^WARNING: Location'
rm "$work/root/src/run.sh"
after=$(du -sm --exclude=src "$work/root" | cut -f1)
chroot "$work/root" dpkg-query -W -f '${Package}\n' | sort > "$work/after.txt"
mb() { du -smc "$@" 2>/dev/null | tail -n 1 | cut -f1; }
echo "venv /opt/jobprobe: $(mb "$work/root/opt/jobprobe") MB"
echo "kernel headers /usr/src: $(mb "$work/root/usr/src") MB"
echo "bcc with LLVM/clang (libLLVM, libclang-cpp, libbcc): $(mb "$work/root"/usr/lib/x86_64-linux-gnu/libLLVM* \
  "$work/root"/usr/lib/llvm-* "$work/root"/usr/lib/x86_64-linux-gnu/libbcc*) MB"
echo "the install added $((after - before)) MB in all;" \
  "packages added: $(comm -13 "$work/before.txt" "$work/after.txt" | wc -l)"
comm -13 "$work/before.txt" "$work/after.txt" | tr '\n' ' '
echo
