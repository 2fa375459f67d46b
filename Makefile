# k3rl: the two-command quick start is `make demo` and `make test`; both set up what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTEST_ARGS ?=
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export PYTHONUNBUFFERED := 1
# one BLAS/OpenMP thread per process: tests, Ray actors and engines share two cores here,
# and oversubscribed torch threads are 10-60x slower than one thread each
export OMP_NUM_THREADS ?= 1
export MPLBACKEND := Agg

.PHONY: setup venv host demo test test-fast test-learning test-sandboxes-nonroot wheel-check bench lint clean

setup: venv host

# The venv: torch 2.13.0 first (the CPU wheel on CPU-only machines, so pip does not pull a
# multi-GB CUDA build), triton 3.6 (the version the GPU image runs, so the interpreter tests
# exercise the same compiler front end), then the package with its dev extra.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q "triton==3.6.0"
	$(PIP) install -q -e ".[dev]"
	@touch $@

# Host services the tests and the demo use: Docker daemon (no bridge network), bubblewrap,
# debootstrap, the offline-built sandbox image, and a headless Chromium for the browser tests.
# Installs only when root on Debian.
host: venv
	@bash sandboxes/host_setup.sh

ifndef DEMO_RUN
DEMO_RUN := demo-$(shell date +%Y%m%d-%H%M%S)
endif
demo: setup
	$(PY) -m k3rl.cli train examples/demo.yaml --set tracking.run_name=$(DEMO_RUN)
	$(PY) -m k3rl.cli compare $(DEMO_RUN) --out runs/$(DEMO_RUN)/reward_curve.png --tracking-uri sqlite:///runs/mlflow.db
	@echo ""
	@echo "reward curve:  runs/$(DEMO_RUN)/reward_curve.png"
	@echo "MLflow UI:     $(VENV)/bin/k3rl ui      (then open http://127.0.0.1:5000)"
	@echo "an episode:    $(VENV)/bin/k3rl replay runs/$(DEMO_RUN) --html runs/$(DEMO_RUN)/episode.html"

test: setup
	$(PY) -m pytest tests --durations=30 $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

# what make test leaves out: the agent job's gain test (about 20 minutes on 2 idle cores)
test-learning: setup
	K3RL_LEARNING_TESTS=1 $(PY) -m pytest tests/test_agent_learning.py $(PYTEST_ARGS)

# the sandbox tests as a user without root: bwrap on rlimits, no cgroups (.ci/run runs it after make test)
test-sandboxes-nonroot: setup
	bash .ci/sandboxes_nonroot

# the package as a user installs it: the wheel (not editable) in a fresh venv, run from outside the repository
wheel-check: venv
	bash .ci/wheel_check $(PY)

bench: setup
	$(PY) benchmarks/sandboxes.py
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/learner.py
	$(PY) benchmarks/pipeline.py

lint: venv
	$(VENV)/bin/ruff check k3rl envs rollout learner kernels sandboxes tests benchmarks experiments examples

clean:
	rm -rf runs .pytest_cache
