"""Training throughput: ``forward_backward(importance_sampling)`` + ``optim_step`` on a batch of
mixed-length datums, against a naive baseline in the same run.

The batch is ``--datums`` datums with lengths spread uniformly over ``[--min-len, --max-len]``
(RL episodes: a prompt with zero advantage, then sampled tokens with an advantage), on a tiny
model (``base`` by default, ~3.4M parameters, built in a temporary directory), LoRA rank 32.

* polyrl: ``TrainingClient.forward_backward`` then ``optim_step`` (the engine sorts datums by
  length and packs them into micro-batches of at most ``micro_batch_tokens`` padded tokens).
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

Run: ``.venv/bin/python benchmarks/train_step.py [--repeats 5] [--threads 1] [--datums 64 --min-len 32 --max-len 256]``.
The last line is ``train_step_vs_naive: X.XXx`` (polyrl tokens/s / naive tokens/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import local_service, randomize_lora  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="base", help="tiny model size: unit | small | quickstart | base")
    ap.add_argument("--datums", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch
    from tinker import types

    from polyrl.local.engine import _micro_batches
    from polyrl.models.tiny import build_tiny_model

    root, service = local_service(args.threads)
    engine = service.engine
    model_dir = str(engine.call(lambda: build_tiny_model(root / "model", args.size, seed=0)))

    tc = service.create_lora_training_client(model_dir, rank=args.rank, seed=0).result()
    vocab = tc._state.base.vocab_size

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
    micro = _micro_batches(lengths, engine.micro_batch_tokens)
    engine_padded = sum(max(lengths[i] for i in b) * len(b) for b in micro)
    naive_padded = max(lengths) * len(lengths)

    # ---- naive baseline: one padded batch through HF + PEFT, loss by hand ------------------
    def build_naive():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
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
        return model, opt, ids, tgt, old, adv

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

    def polyrl_step() -> float:
        fb = tc.forward_backward(data, "importance_sampling")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss

    cases = {"polyrl forward_backward+optim_step": polyrl_step,
             "naive padded HF+PEFT step": lambda: engine.call(naive_step)}
    # warm-up; both sides start from the same weights and run the same math, so their losses agree
    first = {key: fn() for key, fn in cases.items()}
    a, b = first.values()
    assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), f"the two sides disagree on the loss: {first}"
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for key, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)

    n_params = sum(p.numel() for n, p in tc._state.base.hf_model.named_parameters() if "lora_" not in n)
    print(f"model: tiny {args.size!r} ({n_params / 1e6:.2f}M params), LoRA rank {args.rank}, torch {torch.__version__}, "
          f"{engine.call(torch.get_num_threads)} threads, {os.cpu_count()} CPUs")
    print(f"batch: {args.datums} datums, lengths {args.min_len}..{args.max_len}, {real} real tokens, "
          f"importance_sampling, {args.repeats} interleaved runs")
    print(f"padding: engine micro-batching ({len(micro)} micro-batches of <= {engine.micro_batch_tokens} tokens) "
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
    print(f"train_step_vs_naive: {rate['polyrl forward_backward+optim_step'] / rate['naive padded HF+PEFT step']:.2f}x")


if __name__ == "__main__":
    main()
