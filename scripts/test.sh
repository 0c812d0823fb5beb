#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run the whole suite (unit + kernel tier; the kernel tier needs root, which CI has). Arguments go to pytest.
#
# Two phases, about twice as fast as one serial run (docs/PERFORMANCE.md, "The test suite"):
#   1. every test not marked `serial`, on JOBPROBE_TEST_WORKERS pytest-xdist workers (default 4: on this kind of
#      machine the tests wait on their workloads and servers most of the time), one file per worker at a time, the
#      longest files first (tests/conftest.py);
#   2. the `serial` tests alone on the machine (what they assert is a share of it, a cost or a time).
# JOBPROBE_TEST_WORKERS=0: one serial run of everything.
# pytest's exit 5 ("no tests collected") is not a pass when nothing at all was collected: the suite is broken.
set -u
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "test.sh: not root: kernel-tier tests will be skipped (they run in CI, which is root)" >&2
fi
workers=${JOBPROBE_TEST_WORKERS:-4}
# pytest keeps each test module as it rewrote its asserts (tests/__pycache__), unless PYTHONDONTWRITEBYTECODE is set,
# as it is on this kind of machine: then every pytest process — each of phase 1's workers, phase 2 — rewrote all of
# them again (5 s of CPU each; 1.4 s from the cache). Unset for the suite, the cache written once before phase 1.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m pytest -q --collect-only -p no:cacheprovider >/dev/null 2>&1
# the linter first (pyproject.toml [tool.ruff]: import order, unused names, a complexity bound): a second
if ! .venv/bin/ruff check --no-cache --quiet .; then
  echo "test.sh: ruff found the above (\`.venv/bin/ruff check --fix .\` sorts imports)" >&2
  exit 1
fi
if [ "$workers" = 0 ]; then
  .venv/bin/python -m pytest -q -ra --durations=10 "$@"
  rc=$?
  if [ $rc = 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
  exit $rc
fi
t0=$SECONDS
echo "test.sh: phase 1: tests that share the machine (${workers} workers)"
.venv/bin/python -m pytest -q -ra --durations=10 -m "not serial" -n "$workers" --no-loadscope-reorder "$@"
rc1=$?
t1=$SECONDS
echo "test.sh: phase 2: tests that need the machine to themselves (serial)"
.venv/bin/python -m pytest -q -ra --durations=10 -m serial "$@"
rc2=$?
echo "test.sh: phase 1 $((t1 - t0)) s (exit $rc1), phase 2 $((SECONDS - t1)) s (exit $rc2), suite $((SECONDS - t0)) s"
if [ $rc1 = 5 ] && [ $rc2 = 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
for rc in $rc1 $rc2; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
exit 0
