#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The DaemonSet image's build steps (Containerfile); tests/test_image.py runs the same file's steps in a root
# filesystem built from the same Debian release, then runs the agent in it.
#   system         Debian's bcc (python3-bpfcc, which brings python3), without docs, man pages or locales
#   app WHEELDIR   /opt/jobprobe: a virtual environment holding the jobprobe wheel and what the agent imports, all
#                  from WHEELDIR (`make wheels`: built for the image's Python, 3.11), installed by the pip wheel in
#                  WHEELDIR run from the wheel itself; no pip, setuptools or python3-venv stay in the image
#   slim STUBDIR   what a running agent never uses, out: apt and what only it needs, perl-base (no package is
#                  installed after this), and two libraries Debian's LLVM links but bcc never calls replaced by the
#                  stubs in STUBDIR (scripts/image-stubs: libz3, the clang analyzer's solver, 23 MB; ICU's data,
#                  31 MB, reached through libxml2; ICU's other libraries, which nothing links); then bcc must
#                  load with every symbol bound (it compiles where the kernel's headers are: tests/test_image.py)
set -eu
case "${1:-}" in
system)
  printf 'path-exclude /usr/share/%s/*\n' doc man info locale groff lintian > /etc/dpkg/dpkg.cfg.d/jobprobe-slim
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-bpfcc >/dev/null
  apt-get clean
  rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/apt /var/log/dpkg.log
  ;;
app)
  wheels=${2:?app WHEELDIR}
  set -- "$wheels"/pip-*.whl
  [ -f "$1" ] || { echo "image-install: no pip wheel in $wheels (make wheels)" >&2; exit 2; }
  python3 -m venv --without-pip /opt/jobprobe
  site=$(/opt/jobprobe/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"      # bcc's Python module only, not dist-packages
  /opt/jobprobe/bin/python "$1/pip" install -q --isolated --no-index --find-links "$wheels" "$wheels"/jobprobe-*.whl
  ln -sfn /opt/jobprobe/bin/jobprobe /usr/local/bin/jobprobe
  /opt/jobprobe/bin/jobprobe --version
  ;;
slim)
  stubs=${2:?slim STUBDIR}
  lib=/usr/lib/$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH"))')
  for f in libz3.so.4 libicudata.so.72; do
    [ -f "$stubs/$f" ] || { echo "image-install: no $f in $stubs (make wheels)" >&2; exit 2; }
    real=$(readlink -f "$lib/$f")
    [ -f "$real" ] || { echo "image-install: no $lib/$f in this image: the stubs are for Debian bookworm's" >&2; exit 2; }
    cp "$stubs/$f" "$real"
  done
  for f in libicui18n libicuio libicutu libicutest; do     # ICU's other libraries: nothing here links them
    rm -f "$lib/$f.so".*
  done
  dpkg --purge apt libapt-pkg6.0 gpgv debian-archive-keyring libgnutls30 libhogweed6 libnettle8 libp11-kit0 \
    libtasn1-6 libidn2-0 libunistring2 libxxhash0 libseccomp2 >/dev/null
  dpkg --purge --force-remove-essential perl-base >/dev/null 2>&1
  rm -rf /var/log/dpkg.log /var/cache/debconf/*-old /etc/apt /var/lib/apt /var/cache/apt
  /opt/jobprobe/bin/python -c 'import ctypes, os; ctypes.CDLL("libbcc.so.0", os.RTLD_NOW); import bcc' || {
    echo "image-install: bcc does not load with every symbol bound, the stubs in place" >&2; exit 1; }
  ;;
*)
  echo "usage: image-install.sh system | app WHEELDIR | slim STUBDIR" >&2; exit 2 ;;
esac
