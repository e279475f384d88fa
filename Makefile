# The two commands of the README: `make demo` and `make test`. Both set up .venv themselves.
PY := .venv/bin/python
RECIPE ?= tiny_cpu
ARGS ?=

.PHONY: setup demo test test-fast

setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) -m spectrain.cli fit $(RECIPE) $(ARGS)

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"
