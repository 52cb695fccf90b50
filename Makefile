# The two commands a user needs: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
BENCH_VENV := .bench-venv
# The dashboard's browser test drives Debian's Chromium; it is installed from apt, never downloaded.
CHROMIUM := /usr/bin/chromium
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PACKAGES := p2p dht averaging experts workers orchestrator benchmarks tests

.PHONY: demo test bench bench-quick lint install bench-env clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv installs the pinned set in ~50 s where pip takes ~150 s (pip unpacks and compiles one file at a
	# time). uv reads no pip configuration, so the wheel folders pip is told of (PIP_FIND_LINKS, else pip's
	# find-links setting; here, the CPU build of torch) are passed on. Where uv cannot be had or fails, pip does it.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt uv || true
	links="$${PIP_FIND_LINKS:-$$($(BIN)/python -m pip config get global.find-links 2>/dev/null)}"; \
	{ test -x $(BIN)/uv && $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode \
		-c constraints.txt $$(for l in $$links; do printf -- '--find-links %s ' "$$l"; done) -e '.[test]'; } \
	|| $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	# an editable install leaves our own modules uncompiled; where PYTHONDONTWRITEBYTECODE is set, every
	# process (each Ray worker, each simulated instance) would compile them again: compile them once here
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES)
	touch $(STAMP)

demo: $(STAMP)  # CONFIG=cluster_configs/local-moe.yaml runs the mixture-of-experts variant
	$(BIN)/spotswarm demo --duration 150 $(if $(CONFIG),--config $(CONFIG))

# Three phases: the tests that use one core, two at a time; then those marked heavy (Ray, fleets, a
# browser, several training processes), two modules at a time (one at a time they left a quarter of
# the cores idle, waiting on boots, windows and timeouts); then those marked alone (they measure rates
# or bound real time under load), one at a time with nothing beside them. All run; any failing fails.
# PYTHONDONTWRITEBYTECODE is cleared for the tests: pytest then keeps its rewritten test modules in
# __pycache__ instead of rewriting all of them in every process (3.5 CPU-s each).
test: $(STAMP) $(CHROMIUM)
	@rc=0; export PYTHONDONTWRITEBYTECODE=; \
	$(BIN)/python -m pytest -m 'not heavy and not alone' -n 2 || rc=$$?; \
	$(BIN)/python -m pytest -m heavy -n 2 --dist loadfile --no-loadscope-reorder || rc=$$?; \
	$(BIN)/python -m pytest -m alone || rc=$$?; \
	exit $$rc

$(CHROMIUM):
	$(SUDO) apt-get update -qq || true  # stale lists may still hold chromium
	$(SUDO) apt-get install -y -qq --no-install-recommends chromium

BENCHMARKS = $(wildcard benchmarks/bench_*.py) benchmarks/moshpit_convergence.py

bench: $(STAMP)
	@set -e; for b in $(BENCHMARKS); do echo "== $$b"; $(BIN)/python $$b; done

bench-quick: $(STAMP)
	@set -e; for b in $(BENCHMARKS); do echo "== $$b"; $(BIN)/python $$b --quick; done

lint: $(STAMP)
	$(BIN)/ruff check .

# A separate virtualenv with the reference libraries (hivemind, Ray Train, torchft, and matplotlib for plots),
# for the benchmarks' comparisons only: never the project's dependencies.
bench-env:
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		torch==2.13.0 hivemind 'ray[train]==2.60.0' torchft==0.2.0 matplotlib

clean:
	rm -rf $(VENV) $(BENCH_VENV) *.egg-info .pytest_cache .ruff_cache
