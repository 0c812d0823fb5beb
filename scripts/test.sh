#!/usr/bin/env bash
# Run the whole suite (unit + kernel tier; the kernel tier needs root, which CI has). pytest's exit 5 ("no tests
# collected") is not a pass: it means the suite is broken, so it fails here too, with a clear message.
set -u
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "test.sh: not root: kernel-tier tests will be skipped (they run in CI, which is root)" >&2
fi
.venv/bin/python -m pytest -q -ra --durations=10 "$@"
rc=$?
if [ $rc = 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
exit $rc
