#!/bin/sh
# The DaemonSet image's build steps (Containerfile); tests/test_image.py runs the same file's steps in a root
# filesystem built from the same Debian release, then runs the agent in it.
#   system         Debian's bcc (python3-bpfcc, which brings python3), without docs, man pages or locales
#   app WHEELDIR   /opt/jobprobe: a virtual environment holding the jobprobe wheel and what the agent imports, all
#                  from WHEELDIR (`make wheels`: built for the image's Python, 3.11), installed by the pip wheel in
#                  WHEELDIR run from the wheel itself; no pip, setuptools or python3-venv stay in the image
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
*)
  echo "usage: image-install.sh system | app WHEELDIR" >&2; exit 2 ;;
esac
