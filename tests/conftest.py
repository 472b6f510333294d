"""Shared fixtures: tiny models built offline once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


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
