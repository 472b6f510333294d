"""What the benchmarks share: an offline, quiet environment (set on import), the RL rollout shape
options, an in-process local service with a given torch thread count, nonzero LoRA weights for a
training client, and the model the sampling
benchmarks use (the ``base`` tiny model with no end-of-sequence id, so every sample runs to
``max_tokens`` on both sides of a comparison)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")


def add_rollout_args(ap: argparse.ArgumentParser) -> None:
    """The GRPO-shaped sampling workload: prompts x group rows, prompt and completion lengths."""
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)


def local_service(threads: int):
    """A fresh temporary directory and a ``polyrl.local.ServiceClient`` storing under it; ``threads``
    (0: torch's default) applies to this thread and the engine's."""
    import torch

    from polyrl.local import ServiceClient

    root = Path(tempfile.mkdtemp(prefix="polyrl-bench-"))
    service = ServiceClient(store_dir=root / "store")
    if threads:
        torch.set_num_threads(threads)
        service.engine.call(lambda: torch.set_num_threads(threads))
    return root, service


def build_model(root: Path) -> Path:
    from polyrl.models.tiny import build_tiny_model

    path = build_tiny_model(root / "base-model", "base", seed=0)
    gen_config = path / "generation_config.json"
    cfg = json.loads(gen_config.read_text()) if gen_config.exists() else {}
    cfg["eos_token_id"] = None
    gen_config.write_text(json.dumps(cfg))
    return path


def randomize_lora(engine, training_client, std: float = 0.02, seed: int = 0) -> None:
    """Seeded random values for every LoRA parameter (B included), so the LoRA path computes
    something real and every gradient is nonzero. Runs on the engine's worker thread."""
    import torch

    def fill() -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in training_client._state.params:
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    engine.call(fill)
