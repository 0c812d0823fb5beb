#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Build the agent image's two stub libraries into OUTDIR (make wheels runs it): libz3.so.4 (z3.c) and
# libicudata.so.72 (icudata.c); scripts/image-install.sh `slim` puts them in place of Debian's, then checks that
# bcc loads with every symbol bound. Needs a C compiler (cc) on the build host.
set -eu
out=${1:?usage: build.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
cc -shared -fPIC -O2 -s -Wl,-soname,libz3.so.4 -o "$out/libz3.so.4" "$here/z3.c"
cc -shared -fPIC -O2 -s -Wl,-soname,libicudata.so.72 -DICU_MAJOR=72 -o "$out/libicudata.so.72" "$here/icudata.c"
