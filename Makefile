# Quick start (see README): `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install pdserve into it first (once; again when pyproject.toml changes).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= def fibonacci(n):

.PHONY: install kernels demo test test-fast lint bench clean

install: $(STAMP) kernels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned to the CPU wheel (2.13.0); an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

# The compiled CPU attention kernel: built once per source and CPU (about a minute), then cached.
kernels: $(STAMP)
	$(BIN)/python -m kernels.cpu_ops

demo: install
	$(BIN)/pdserve demo configs/local.yaml "$(PROMPT)" --max-tokens 48

test: install
	$(BIN)/python -m pytest -q

# The edit-test loop: unit, kernel and layering tests, no cluster, Ray or GPU (under a minute).
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not cluster and not ray and not gpu" tests/unit tests/kernels tests/test_*.py

# Lint and type check (what CI runs before the tests).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: install
	$(BIN)/python benchmarks/engine_steps.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
