"""What the benchmarks share: an offline, quiet environment (set on import), the RL rollout shape
options, an in-process local service with a given torch thread count, nonzero LoRA weights for a
training client, a model's weight matrices and the machine's matmul roofline, and the model the sampling
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


def local_service(threads: int, **local):
    """A fresh temporary directory and a ``polyrl.local.ServiceClient`` storing under it (``local``: its
    other settings, e.g. ``sampler_dtype``); ``threads`` (0: torch's default) applies to this thread and
    the engine's."""
    import torch

    from polyrl.local import ServiceClient

    root = Path(tempfile.mkdtemp(prefix="polyrl-bench-"))
    service = ServiceClient(store_dir=root / "store", **local)
    if threads:
        torch.set_num_threads(threads)
        service.engine.call(lambda: torch.set_num_threads(threads))
    return root, service


def add_model_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="a model directory (e.g. SmolLM2-135M-Instruct from "
                                    "`polyrl tiny-model OUT --size smollm2-135m-instruct`) "
                                    "instead of the tiny model")


def build_model(root: Path, model: str | None = None) -> Path:
    """The benchmark's model under ``root``: the ``base`` tiny model, or ``model`` (a directory, linked
    file by file, not copied); either way with no end-of-sequence id in its generation config."""
    from polyrl.models.tiny import build_tiny_model

    path = root / "base-model"
    if model is None:
        build_tiny_model(path, "base", seed=0)
    else:
        source = Path(model).resolve()
        if not (source / "config.json").is_file():
            raise SystemExit(f"--model {model}: not a model directory (no config.json)")
        path.mkdir(parents=True)
        for item in source.iterdir():
            if item.name != "generation_config.json":
                (path / item.name).symlink_to(item)
        if (source / "generation_config.json").exists():
            (path / "generation_config.json").write_text((source / "generation_config.json").read_text())
    gen_config = path / "generation_config.json"
    cfg = json.loads(gen_config.read_text()) if gen_config.exists() else {}
    cfg["eos_token_id"] = None
    gen_config.write_text(json.dumps(cfg))
    return path


def placement(training_client):
    """The learner's device and dtype (what ``local.device``/``local.dtype`` resolved to): where a
    benchmark's peer (Hugging Face generate, a hand-written trainer) runs, so both sides compute alike,
    on a CPU or a GPU."""
    base = training_client._state.base
    return base.device, base.dtype


def synchronize(device) -> None:
    """Wait for ``device``'s queued work (a GPU's kernels run asynchronously), so a wall-clock time
    covers it."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


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


def linear_weights(model) -> list:
    """Every distinct weight matrix of the base model (tied ones once, LoRA factors left out), in
    forward order."""
    import torch

    seen, found = set(), []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name and id(module.weight) not in seen:
            seen.add(id(module.weight))
            found.append(module.weight)
    return found


def timed(fn, device) -> float:
    """Seconds of one ``fn()``, the device synchronized before and after."""
    import time

    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def matmul_rate(n: int = 2048, dtype=None, device="cpu", repeats: int = 5) -> float:
    """The roofline: best GFLOP/s of an ``n`` x ``n`` ``a @ b`` in ``dtype`` (float32 by default) on this
    thread, with its torch thread count."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    return 2 * n**3 / min(timed(lambda: a @ b, device) for _ in range(repeats)) / 1e9
