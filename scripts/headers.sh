# SPDX-License-Identifier: Apache-2.0
# Sourced by scripts/setup.sh and scripts/install.sh: what a venv needs from the distribution to run bcc —
# link_bcc, and kernel_headers: the running kernel's headers where bcc looks for them
# (/lib/modules/$(uname -r)/build), from the distribution's package for this kernel, or else the newest packaged
# cloud-amd64 headers linked there (a custom or VM kernel has no package of its own; see docs/DEPLOY.md).
# Needs: log(), as_root(). `kernel_headers unpack`: where the nearest headers are taken, unpack them (dpkg-deb -x)
# instead of installing them — their package depends on that other kernel's image and on gcc, for building modules
# against it, which nothing here does; bcc's compiler only reads the header files (scripts/install.sh node).
kernel_headers() {
  local kver moddir pick d
  local tmpd
  kver=$(uname -r)
  moddir=/lib/modules/$kver
  if [ -e "$moddir/build/include/linux/kconfig.h" ] || [ -e "$moddir/build/Makefile" ]; then
    return 0
  fi
  if apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then
    log "installing linux-headers-$kver"
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
      "linux-headers-$kver" >/dev/null
    return 0
  fi
  [ -n "$(apt-cache search --names-only '^linux-headers-[0-9].*-cloud-amd64$' 2>/dev/null)" ] ||
    as_root apt-get update -qq
  pick=$(apt-cache search --names-only '^linux-headers-[0-9].*-cloud-amd64$' | awk '{print $1}' \
         | sed 's/^linux-headers-//; s/-cloud-amd64$//' | sort -V | tail -n 1)
  [ -n "$pick" ] || { log "no kernel headers package found"; return 1; }
  if [ ! -d "/usr/src/linux-headers-$pick-cloud-amd64" ] && [ "${1:-}" = unpack ]; then
    log "no headers packaged for $kver; unpacking the nearest: linux-headers-$pick-{cloud-amd64,common}"
    tmpd=$(mktemp -d)
    (cd "$tmpd" && as_root apt-get download -qq "linux-headers-$pick-cloud-amd64" "linux-headers-$pick-common" \
       2>/dev/null)
    # into a scratch directory first: unpacked over /, the packages' lib/ would replace the merged-/usr link
    for d in "$tmpd"/*.deb; do as_root dpkg-deb -x "$d" "$tmpd/x"; done
    as_root cp -a "$tmpd/x/usr/src/." /usr/src/
    rm -rf "$tmpd"
  elif [ ! -d "/usr/src/linux-headers-$pick-cloud-amd64" ]; then
    log "no headers packaged for $kver; installing the nearest: linux-headers-$pick-cloud-amd64"
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
      "linux-headers-$pick-cloud-amd64" >/dev/null
  fi
  as_root mkdir -p "$moddir"
  as_root ln -sfn "/usr/src/linux-headers-$pick-cloud-amd64" "$moddir/build"
  as_root ln -sfn "/usr/src/linux-headers-$pick-common" "$moddir/source"
}

# the distribution's bcc seen from the venv of PYTHON: its Python module (pure ctypes) linked in, not all of
# dist-packages
link_bcc() {
  local site
  [ -d /usr/lib/python3/dist-packages/bcc ] ||
    { log "bcc's Python module is not installed (apt install python3-bpfcc)"; return 2; }
  site=$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  [ -e "$site/bcc" ] || ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
}

# apt packages not yet installed, from the arguments, installed in one go
apt_install() {
  local need=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
  done
  [ ${#need[@]} -gt 0 ] || return 0
  log "apt-get install ${need[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}
