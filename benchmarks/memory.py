"""Peak memory of one training step: polyrl's engine against a naive Hugging Face + PEFT step.

Workload: ``forward_backward(importance_sampling)`` + ``optim_step`` on ``--datums`` x ``--tokens``
random tokens, LoRA rank 32 on every linear layer, on a Qwen3-0.6B-shaped model (random weights, the
real shapes and 151,936-token vocabulary; built offline into a temporary directory) or ``--model DIR``.

Each case runs in a fresh subprocess that reports its peak resident set size (``ru_maxrss``) and the
RSS after the model and the LoRA were set up, so ``(peak - set-up) / tokens`` is the memory one more
training token costs. The naive step (one padded batch through the PEFT model, full-vocabulary
logits, ``torch.optim.AdamW``) keeps every activation and several float32 copies of the logits: at
8 x 1024 tokens it needs ~31 GB, so it runs at ``--naive-datums`` x ``--naive-tokens`` instead and the
comparison is per token.

Run: ``.venv/bin/python benchmarks/memory.py [--model DIR] [--datums 8 --tokens 1024]
[--naive-datums 1 --naive-tokens 512]``.
The last line is ``memory_per_token_vs_naive: X.XXx`` (naive MB per token / polyrl MB per token).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _models  # noqa: E402,F401  (quiet, offline environment)

BAR_GB = 6.0


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def batch(vocab: int, datums: int, tokens: int):
    import torch
    from tinker import types

    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(datums):
        ids = torch.randint(0, vocab, (tokens + 1,), generator=gen)
        adv = torch.zeros(tokens)
        adv[tokens // 4 :] = 1.0
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
            loss_fn_inputs={"target_tokens": types.TensorData.from_torch(ids[1:]),
                            "logprobs": types.TensorData.from_torch(-torch.rand(tokens, generator=gen) * 5),
                            "advantages": types.TensorData.from_torch(adv)}))
    return data


def run_polyrl(args) -> dict:
    from tinker import types

    from polyrl.local import ServiceClient

    service = ServiceClient(store_dir=tempfile.mkdtemp(prefix="polyrl-bench-"),
                            micro_batch_tokens=args.micro_batch_tokens,
                            gradient_checkpointing=args.checkpointing)
    tc = service.create_lora_training_client(args.model, rank=32, seed=0).result()
    data = batch(tc._state.base.vocab_size, args.datums, args.tokens)
    setup = rss_mb()
    t0 = time.perf_counter()
    out = tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-5)).result()
    return {"setup_mb": setup, "peak_mb": peak_mb(), "seconds": time.perf_counter() - t0,
            "loss": out.metrics["loss:sum"], "checkpointing": tc._state.base.gradient_checkpointing,
            "params": tc._state.base.num_parameters}


def run_naive(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear)})
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    data = batch(model.get_output_embeddings().weight.shape[0], args.datums, args.tokens)
    ids = torch.tensor([d.model_input.to_ints() for d in data])
    tgt = torch.stack([d.loss_fn_inputs["target_tokens"].to_torch() for d in data]).long()
    old = torch.stack([d.loss_fn_inputs["logprobs"].to_torch() for d in data])
    adv = torch.stack([d.loss_fn_inputs["advantages"].to_torch() for d in data])
    setup = rss_mb()
    t0 = time.perf_counter()
    logits = model(input_ids=ids, use_cache=False).logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    loss = -(torch.exp(lp - old) * adv).sum()
    loss.backward()
    opt.step()
    return {"setup_mb": setup, "peak_mb": peak_mb(), "seconds": time.perf_counter() - t0, "loss": float(loss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: a Qwen3-0.6B-shaped model built offline)")
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per datum")
    ap.add_argument("--naive-datums", type=int, default=1)
    ap.add_argument("--naive-tokens", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--checkpointing", default="auto", choices=["auto", "true", "false"])
    # one case, in a subprocess
    ap.add_argument("--case", choices=["polyrl", "naive"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.checkpointing = {"auto": "auto", "true": True, "false": False}[args.checkpointing]

    if args.case:
        result = (run_polyrl if args.case == "polyrl" else run_naive)(args)
        print("RESULT " + json.dumps(result))
        return

    if args.model is None:
        from polyrl.models.tiny import build_tiny_model

        args.model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="polyrl-bench-")) / "qwen3-0.6b",
                                          "qwen3-0.6b", seed=0))

    def case(name: str, datums: int, tokens: int) -> dict:
        cmd = [sys.executable, __file__, "--case", name, "--model", args.model, "--datums", str(datums),
               "--tokens", str(tokens), "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--checkpointing", {"auto": "auto", True: "true", False: "false"}[args.checkpointing]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{name} case failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        result["tokens"] = datums * tokens
        result["mb_per_token"] = (result["peak_mb"] - result["setup_mb"]) / result["tokens"]
        return result

    polyrl = case("polyrl", args.datums, args.tokens)
    naive = case("naive", args.naive_datums, args.naive_tokens)
    print(f"model: {args.model} ({polyrl['params'] / 1e6:.0f}M parameters), "
          f"LoRA rank 32 on every linear layer, float32 on CPU; "
          f"polyrl: micro_batch_tokens {args.micro_batch_tokens}, gradient checkpointing "
          f"{'on' if polyrl['checkpointing'] else 'off'} ({args.checkpointing})")
    print(f"{'case':<34} {'tokens':>7} {'set-up MB':>10} {'peak MB':>9} {'MB/token':>9} {'step s':>7}")
    for name, r, shape in (("polyrl forward_backward+optim_step", polyrl, f"{args.datums}x{args.tokens}"),
                           ("naive HF+PEFT step", naive, f"{args.naive_datums}x{args.naive_tokens}")):
        print(f"{name:<34} {shape:>7} {r['setup_mb']:10.0f} {r['peak_mb']:9.0f} {r['mb_per_token']:9.3f} "
              f"{r['seconds']:7.1f}")
    naive_at_full = naive["setup_mb"] + naive["mb_per_token"] * polyrl["tokens"]
    print(f"naive at {args.datums}x{args.tokens} tokens would peak near {naive_at_full / 1024:.1f} GB")
    ok = polyrl["peak_mb"] <= BAR_GB * 1024
    print(f"polyrl peak {polyrl['peak_mb'] / 1024:.2f} GB: "
          f"{'within' if ok else 'OVER'} the {BAR_GB:g} GB bar")
    print(f"memory_per_token_vs_naive: {naive['mb_per_token'] / polyrl['mb_per_token']:.2f}x")


if __name__ == "__main__":
    main()
