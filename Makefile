# `make demo` and `make test` work on a fresh machine: both create .venv when it is missing.
# `make demo` installs what the demo needs (torch, this package and its lightning extra: the demo is a Lightning
# run); `make test` adds the test extra on top (transformers, DeepSpeed, Ray, Megatron-core, ...), so a first
# demo stays small and quick.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build that lies on this machine; elsewhere a plain `torch` from PyPI pulls a multi-GB CUDA build on
# Linux: give the CPU wheels' index, e.g. make demo TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
DEMO_STAMP := $(VENV)/.weightsync-demo
STAMP := $(VENV)/.weightsync-installed

.PHONY: test demo lint bench soak clean

$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[lightning]"
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	# torchtitan's own requirements pull `datasets`, which conflicts with transformers: only what its
	# ParallelDims import needs (docs/torchtitan.md).
	$(PY) -m pip install -q --no-deps torchtitan spmd_types tyro docstring-parser typeguard
	touch $(STAMP)

# Most tests wait on rank processes they spawn: two workers keep both cores busy. TEST_WORKERS=3 adds a third
# that runs, one after the other, the files that mostly wait out deadlines (tests/lanes.py): 263 s of tests
# against 279 s on two workers, back to back on this 2-core host. 4 of its first 10 runs failed a test the
# added load exposed (a port taken, a writer thread starved, a torchft replica out of its quorum); with the
# first two fixed, its next 9 runs passed, the third not seen again. Small gain: not the default. Files stay whole on one
# worker (module fixtures are built once), the longest first (tests/conftest.py HEAVIEST_FIRST: xdist's own
# reordering, by number of tests, is off); the session's shared runs are built once for all workers
# (tests/conftest.py once_per_session). A launch whose point is its script and launcher (a Trainer's ranks, torchrun's,
# Ray's workers, the docs pages' commands) starts through one warm interpreter per worker, which has imported torch
# and the Trainers once (tests/conftest.py warm_python). TEST_WORKERS=0 runs in one process.
# The tests build no DeepSpeed op (its shm_comm op, about a CPU-minute, serves inference only: see
# tests/test_replicas_deepspeed.py). Any torch extension a run still compiles goes to TORCH_EXTENSIONS_DIR,
# by default one folder per user, where a build from another venv's paths is rebuilt: kept in this venv.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): every launched
# process (torchrun, ddp_spawn, the CLI) would compile the package again, and each worker its test modules.
TEST_WORKERS ?= 2
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= TORCH_EXTENSIONS_DIR="$${TORCH_EXTENSIONS_DIR:-$(abspath $(VENV))/torch-extensions}" \
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: $(DEMO_STAMP)
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
