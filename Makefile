# The two commands (see README): `make demo` and `make test`. Both set everything up first and are idempotent.
PY := .venv/bin/python
# release artifacts (docs/DEPLOY.md): built in a venv of their own that holds only `build`, never the test stack
DIST ?= dist
BUILDPY := .build-venv/bin/python

.PHONY: setup demo test test-unit bench clean dist wheels install-node install-controller

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

# the sdist and the wheel: DIST/jobprobe-VERSION.tar.gz, DIST/jobprobe-VERSION-py3-none-any.whl
dist:
	@[ -x $(BUILDPY) ] || { python3 -m venv .build-venv && $(BUILDPY) -m pip install -q build; }
	rm -f $(DIST)/jobprobe-*
	$(BUILDPY) -m build -q -o $(DIST) . >/dev/null
	@ls $(DIST)/jobprobe-*

# DIST/wheels: the wheel, every dependency of a node's install and pip, for the image (Containerfile), which runs
# Debian bookworm's Python 3.11 — the wheels are built by this host's python3, which must be a 3.11 too
wheels: dist
	@$(BUILDPY) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; \
	  sys.exit(0 if v == "3.11" else f"make wheels: the image runs Python 3.11, python3 here is {v}")'
	rm -rf $(DIST)/wheels
	$(BUILDPY) -m pip wheel -q -w $(DIST)/wheels $(DIST)/jobprobe-*.whl
	$(BUILDPY) -m pip download -q --no-deps -d $(DIST)/wheels pip
	sh scripts/image-stubs/build.sh $(DIST)/wheels/stubs
	@ls $(DIST)/wheels

# a node (the agent) or the controller's host, from the wheel: scripts/install.sh (docs/DEPLOY.md)
install-node: dist
	bash scripts/install.sh node --wheel $$(ls $(DIST)/jobprobe-*.whl)

install-controller: dist
	bash scripts/install.sh controller --wheel $$(ls $(DIST)/jobprobe-*.whl)

clean:
	rm -rf .venv .build-venv dist out *.egg-info
