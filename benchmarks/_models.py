"""The model the sampling benchmarks share: the ``base`` tiny model with no end-of-sequence id, so
every sample runs to ``max_tokens`` on both sides of a comparison."""

from __future__ import annotations

import json
from pathlib import Path


def build_model(root: Path) -> Path:
    from polyrl.models.tiny import build_tiny_model

    path = build_tiny_model(root / "base-model", "base", seed=0)
    gen_config = path / "generation_config.json"
    cfg = json.loads(gen_config.read_text()) if gen_config.exists() else {}
    cfg["eos_token_id"] = None
    gen_config.write_text(json.dumps(cfg))
    return path
