# `make test` and `make demo` work on a fresh machine: both create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.weightsync-installed

.PHONY: test demo lint bench soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build that lies on this machine; a plain `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# torchtitan's own requirements pull `datasets`, which conflicts with transformers: only what its
	# ParallelDims import needs (docs/torchtitan.md).
	$(PY) -m pip install -q --no-deps torchtitan spmd_types tyro docstring-parser typeguard
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(VENV)/bin/weightsync-audit demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/bench_audit.py

soak: $(STAMP)
	$(PY) -m pytest -q -m soak -p no:cacheprovider

clean:
	rm -rf $(VENV) build dist *.egg-info
