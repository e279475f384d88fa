# The two commands of the README: `make demo` and `make test`. Both set up .venv themselves.
PY := .venv/bin/python
RECIPE ?= tiny_cpu
ARGS ?=

.PHONY: setup demo test test-fast lint typecheck

setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) -m spectrain fit $(RECIPE) $(ARGS)

lint: setup
	.venv/bin/ruff check .

typecheck: setup
	@bash scripts/typecheck.sh

test: lint typecheck
	$(PY) -m pytest -q -ra --durations=30

test-fast: lint typecheck
	$(PY) -m pytest -q -ra -m "not slow"
