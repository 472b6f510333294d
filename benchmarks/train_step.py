"""Training throughput: ``forward_backward(importance_sampling)`` + ``optim_step`` on a batch of
mixed-length datums, against a naive baseline in the same run; and a GRPO-shaped batch whose
groups share their prompts, against the same lengths with distinct prompts.

The batch is ``--datums`` datums with lengths spread uniformly over ``[--min-len, --max-len]``
(RL episodes: a prompt with zero advantage, then sampled tokens with an advantage), on a tiny
model (``base`` by default, ~3.4M parameters, built in a temporary directory) or ``--model DIR``,
LoRA rank 32.

* polyrl: ``TrainingClient.forward_backward`` then ``optim_step`` (the engine packs datums into
  rows without padding between them, sharing common prefixes, in micro-batches of at most
  ``micro_batch_tokens`` tokens).
* naive: the same LoRA (a Hugging Face model + PEFT loaded from the same checkpoint), the whole
  batch right-padded to the longest datum in one forward/backward, the importance-sampling loss
  written out by hand, ``torch.optim.AdamW``.

Both count only real (unpadded) tokens. Padding waste is padded positions / real tokens. Both
sides start from the same LoRA weights and optimizer settings, so their first-step losses must
agree (checked). The table shows the median and best wall-clock step and the median CPU time
(all threads); the ratio uses the best step, the estimate least disturbed by other load (on a
shared machine ``--threads 1`` gives the steadiest figures). All heavy
torch work (both sides, and building the model) runs on the engine's worker thread: with
libgomp, once two threads each own an OpenMP pool, the pools' workers stop spinning between
parallel regions and tiny-op CPU workloads slow down ~2x, which would blur the comparison.

The shared-prefix case (``--groups`` x ``--group`` datums, ``--prompt-len``-token prompts shared
within a group, ``--completion-len``-token completions) times polyrl on that batch and on a batch of
the same lengths whose prompts all differ; the engine computes each shared prompt once.

Run: ``.venv/bin/python benchmarks/train_step.py [--model DIR] [--repeats 5] [--threads 1]
[--datums 64 --min-len 32 --max-len 256]``.
The last two lines are ``shared_prefix_vs_distinct: X.XXx`` (distinct-prompt step time / shared-prompt
step time) and ``train_step_vs_naive: X.XXx`` (polyrl tokens/s / naive tokens/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import local_service, placement, randomize_lora  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="base", help="tiny model size: unit | small | quickstart | base")
    ap.add_argument("--model", help="a model directory instead of a tiny model (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--completion-len", type=int, default=24)
    ap.add_argument("--case", choices=["all", "mixed", "shared"], default="all")
    ap.add_argument("--datums", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--micro-batch-tokens", type=int, help="the engine's local.micro_batch_tokens (default: "
                                                           "the engine's own)")
    ap.add_argument("--attention", choices=["auto", "dense", "tree", "flex"], default="auto",
                    help="the engine's local.attention (flex: FlexAttention, compiled on CUDA; on a CPU a "
                         "training pass runs its mask densely, so time it on a GPU)")
    args = ap.parse_args()

    import torch
    from tinker import types

    from polyrl.local.packing import micro_batches
    from polyrl.models.tiny import build_tiny_model

    local = {"micro_batch_tokens": args.micro_batch_tokens} if args.micro_batch_tokens else {}
    local["attention"] = args.attention
    root, service = local_service(args.threads, **local)
    engine = service.engine
    model_dir = args.model or str(engine.call(lambda: build_tiny_model(root / "model", args.size, seed=0)))

    tc = service.create_lora_training_client(model_dir, rank=args.rank, seed=0).result()
    vocab = tc._state.base.vocab_size
    device, dtype = placement(tc)  # the naive peer runs where and as polyrl's learner does

    randomize_lora(engine, tc)
    ckpt = tc.save_state("bench").result().path
    adapter_dir = engine.store.resolve(ckpt)[1]

    # ---- the batch ------------------------------------------------------------------------
    gen = torch.Generator().manual_seed(1)
    lengths = torch.linspace(args.min_len, args.max_len, args.datums).round().long().tolist()
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]
    data, rows = [], []
    for n in lengths:
        ids = torch.randint(0, vocab, (n + 1,), generator=gen)
        prompt = max(1, n // 4)
        adv = torch.zeros(n)
        adv[prompt:] = float(torch.randn(1, generator=gen))
        old = -torch.rand(n, generator=gen) * 8
        rows.append((ids[:-1], ids[1:], old, adv))
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
            loss_fn_inputs={"target_tokens": types.TensorData.from_torch(ids[1:]),
                            "logprobs": types.TensorData.from_torch(old),
                            "advantages": types.TensorData.from_torch(adv)}))
    real = sum(lengths)
    per_pair = tc._state.base.linear_per_pair
    tree = tc._state.base.tree_attention  # how the engine packs (rows fill up under tree attention)
    flex = tc._state.base.attention == "flex"
    micro = micro_batches([d.model_input.to_ints() for d in data], engine.micro_batch_tokens, per_pair,
                          tree=tree, flex=flex)
    engine_padded = sum(mb.tokens for mb in micro)
    naive_padded = max(lengths) * len(lengths)
    n_params = sum(p.numel() for n, p in tc._state.base.hf_model.named_parameters() if "lora_" not in n)
    model_name = args.model or f"tiny {args.size!r}"
    print(f"model: {model_name} ({n_params / 1e6:.2f}M params), LoRA rank {args.rank}, "
          f"torch {torch.__version__}, on {device} in {str(dtype).removeprefix('torch.')} (both sides), "
          f"{engine.call(torch.get_num_threads)} threads, {os.cpu_count()} CPUs, "
          f"attention {tc._state.base.attention}")

    def polyrl_step(batch) -> float:
        fb = tc.forward_backward(batch, "importance_sampling")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss

    def interleaved(cases: dict) -> tuple[dict, dict, dict]:
        first = {key: fn() for key, fn in cases.items()}  # warm-up
        times: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
            for key, fn in cases.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
        return first, times, cpu

    # ---- shared prompts vs distinct prompts --------------------------------------------------
    shared_ratio = None
    if args.case in ("all", "shared"):
        def grpo_batch(shared: bool) -> list:
            out = []
            n = args.prompt_len + args.completion_len
            for _ in range(args.groups):
                prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen)
                for _ in range(args.group):
                    p = prompt if shared else torch.randint(0, vocab, (args.prompt_len,), generator=gen)
                    ids = torch.cat([p, torch.randint(0, vocab, (args.completion_len,), generator=gen)])
                    adv = torch.zeros(n - 1)
                    adv[args.prompt_len - 1:] = float(torch.randn(1, generator=gen))
                    out.append(types.Datum(
                        model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(ids[1:]),
                                        "logprobs": types.TensorData.from_torch(
                                            -torch.rand(n - 1, generator=gen) * 8),
                                        "advantages": types.TensorData.from_torch(adv)}))
            return out

        shared_batch, distinct_batch = grpo_batch(True), grpo_batch(False)
        packed = sum(int(mb.input_ids.numel()) for mb in micro_batches(
            [d.model_input.to_ints() for d in shared_batch], engine.micro_batch_tokens, per_pair, tree=tree,
            flex=flex))
        _, times, cpu = interleaved({"shared prompts": lambda: polyrl_step(shared_batch),
                                     "distinct prompts": lambda: polyrl_step(distinct_batch)})
        tokens = sum(d.model_input.length for d in shared_batch)
        print(f"shared-prefix batch: {args.groups} groups x {args.group} samples, "
              f"{args.prompt_len}-token prompts, {args.completion_len}-token completions = {tokens} datum "
              f"tokens; packed into {packed} positions ({tokens / packed:.2f}x fewer), "
              f"{args.repeats} interleaved runs")
        print(f"{'case':<36} {'median s':>9} {'best s':>8} {'CPU s':>7}")
        for key, ts in times.items():
            print(f"{key:<36} {statistics.median(ts):9.3f} {min(ts):8.3f} {statistics.median(cpu[key]):7.3f}")
        shared_ratio = min(times["distinct prompts"]) / min(times["shared prompts"])
        if args.case == "shared":
            print(f"shared_prefix_vs_distinct: {shared_ratio:.2f}x")
            return

    # ---- naive baseline: one padded batch through HF + PEFT, loss by hand ------------------
    def build_naive():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        # PEFT keeps the LoRA factors in float32 over a 16-bit base, as polyrl's learner does
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True).to(device)
        model.eval()  # no dropout, as the engine
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        width = max(lengths)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        tgt = torch.zeros_like(ids)
        old = torch.zeros((len(rows), width))
        adv = torch.zeros((len(rows), width))
        for i, (x, t, o, a) in enumerate(rows):
            ids[i, : len(x)], tgt[i, : len(x)], old[i, : len(x)], adv[i, : len(x)] = x, t, o, a
        return model, opt, *(t.to(device) for t in (ids, tgt, old, adv))

    naive = engine.call(build_naive)

    def naive_step() -> float:
        model, opt, ids, tgt, old, adv = naive
        logits = model(input_ids=ids, use_cache=False).logits.float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        loss = -(torch.exp(lp - old) * adv).sum()  # padded positions have zero advantage
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    cases = {"polyrl forward_backward+optim_step": lambda: polyrl_step(data),
             "naive padded HF+PEFT step": lambda: engine.call(naive_step)}
    # both sides start from the same weights and run the same math, so their first losses agree
    first, times, cpu = interleaved(cases)
    a, b = first.values()
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2  # 16-bit weights round differently when packed
    assert abs(a - b) <= tolerance * max(1.0, abs(a)), f"the two sides disagree on the loss: {first}"
    print(f"batch: {args.datums} datums, lengths {args.min_len}..{args.max_len}, {real} real tokens, "
          f"importance_sampling, {args.repeats} interleaved runs")
    print(f"padding: engine packing ({len(micro)} micro-batches of <= {engine.micro_batch_tokens} tokens) "
          f"{engine_padded - real} padded positions = {(engine_padded - real) / real:.1%} of real tokens; "
          f"naive pad-to-max {naive_padded - real} = {(naive_padded - real) / real:.1%}")
    print(f"loss on the first step: polyrl {a:.4f}, naive {b:.4f}")
    print(f"{'case':<36} {'median s':>9} {'tokens/s':>9} {'best s':>8} {'tokens/s':>9} {'CPU s':>7}")
    rate = {}
    for key, ts in times.items():
        t = statistics.median(ts)
        rate[key] = real / min(ts)
        print(f"{key:<36} {t:9.3f} {real / t:9.0f} {min(ts):8.3f} {rate[key]:9.0f} "
              f"{statistics.median(cpu[key]):7.3f}")
    if shared_ratio is not None:
        print(f"shared_prefix_vs_distinct: {shared_ratio:.2f}x")
    print(f"train_step_vs_naive: "
          f"{rate['polyrl forward_backward+optim_step'] / rate['naive padded HF+PEFT step']:.2f}x")


if __name__ == "__main__":
    main()
