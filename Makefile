# `make test` and `make quickstart` set themselves up: .venv in the repo root, torch, polyrl.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build by default. On a GPU machine: make TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124" test
# (or install any torch into .venv first: an importable torch is kept as it is).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.polyrl-installed

.PHONY: test test-fast quickstart install bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	@$(PY) -m pip install -q -e ".[dev,serve,openreward,verifiers,reasoning_gym,textarena,gem]"
	@$(PY) -m pip install -q --no-deps gem-llm
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

quickstart: $(STAMP)
	$(PY) -m polyrl.quickstart

bench: $(STAMP)
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/train_step.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
