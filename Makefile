# The two commands (see README): `make demo` and `make test`. Both set everything up first and are idempotent.
PY := .venv/bin/python

.PHONY: setup demo test test-unit bench clean

setup:
	bash scripts/setup.sh

demo:
	bash scripts/setup.sh --torch
	bash scripts/demo.sh

test:
	bash scripts/setup.sh --torch
	bash scripts/test.sh

bench:
	bash scripts/setup.sh --torch --bench
	bash scripts/bench.sh

test-unit: setup
	$(PY) -m pytest -q -m "not kernel and not integration"

clean:
	rm -rf .venv out *.egg-info
