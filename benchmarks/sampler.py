"""Sampling throughput: polyrl's ``SamplingClient.sample`` against Hugging Face ``model.generate``.

The workload is an RL rollout batch: ``--prompts`` distinct prompts, a group of ``--group``
samples each, ``--new-tokens`` new tokens per sample, on the ``base`` tiny model (~3.4M
parameters, built in a temporary directory) or ``--model DIR``. Both sides generate exactly the same number of
tokens: the model's end-of-sequence id is removed from its generation config (so polyrl, which
always stops at EOS, runs every row to ``max_tokens``), and HF gets
``min_new_tokens = max_new_tokens``. Sampling is plain temperature 1 on both sides (no top-k /
top-p), so the per-token work is the same.

polyrl is measured two ways, as an RL loop calls it:

* ``polyrl n=1 x group``: prompts x group ``sample(num_samples=1)`` calls all submitted before
  waiting on any (what ``asyncio.gather`` over a group's episodes does);
* ``polyrl n=group``: one ``sample(num_samples=group)`` call per prompt.

and on both the bare base model and a LoRA snapshot (``save_weights_and_get_sampling_client``);
HF generate runs the same batch through the bare model and through a PEFT model with the same
LoRA weights. The last line is the headline ratio, polyrl (n=1 x group, as an RL rollout issues
requests) against HF generate on the same base model: ``sampler_vs_hf_generate: X.XXx``.

All heavy torch work (building the model, loading the HF baselines, HF generate) runs on the
engine's worker thread, where polyrl samples: with libgomp, once a second thread owns an OpenMP
pool, both pools' workers stop spinning between parallel regions and a tiny-op workload like this
one runs ~2x slower, whichever side is measured. Each case is timed ``--repeats`` times,
interleaved with the others; the table shows the median and the best wall-clock run and the
median CPU time (all threads). Ratios use the best run, the estimate least disturbed by other
load; on a shared machine ``--threads 1`` gives the steadiest figures.

With ``--vllm`` (a model vLLM runs: head_dim 32 or more, e.g. SmolLM2), the same requests also go through
polyrl's vLLM sampler (``local.sampler: vllm``: a vLLM server started from ``.venv-vllm``, the LoRA loaded
into it as the trainer's snapshots are), and the last line is vLLM's rate against polyrl's own sampler:
``vllm_vs_polyrl_sampler: X.XXx`` (above 1: vLLM is faster). vLLM runs in its own processes, so on a CPU
the two compete for the same cores only while one of them is measured.

Run: ``.venv/bin/python benchmarks/sampler.py [--model DIR] [--repeats 5] [--threads 1]
[--prompts 8 --group 8 --new-tokens 64] [--vllm]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import (  # noqa: E402
    add_model_arg,
    add_rollout_args,
    build_model,
    local_service,
    placement,
    randomize_lora,
    synchronize,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rollout_args(ap)
    add_model_arg(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--vllm", action="store_true", help="also sample through vLLM (local.sampler: vllm)")
    args = ap.parse_args()

    import torch
    from peft import PeftModel
    from tinker import types
    from transformers import AutoModelForCausalLM

    root, service = local_service(args.threads)
    engine = service.engine
    model_dir = str(engine.call(lambda: build_model(root, args.model)))
    trainer = service.create_lora_training_client(model_dir, rank=32, seed=0).result()

    randomize_lora(engine, trainer)
    ckpt = trainer.save_weights_for_sampler("bench").result().path
    lora_sampler = service.create_sampling_client(model_path=ckpt).result()
    base_sampler = service.create_sampling_client(base_model=model_dir).result()
    adapter_dir = engine.store.resolve(ckpt)[1]
    device, dtype = placement(trainer)  # HF generate runs where and as polyrl's learner does

    def load_hf():
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        lora = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype),
                                         str(adapter_dir)).to(device).eval()
        return plain, lora

    hf, hf_lora = engine.call(load_hf)
    n_params = sum(p.numel() for p in hf.parameters())

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, hf.config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    rows = args.prompts * args.group
    total_new = rows * args.new_tokens
    params = types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0)

    def polyrl_n1(sampler) -> int:
        futs = [sampler.sample(types.ModelInput.from_ints(p), 1, params)
                for p in prompts for _ in range(args.group)]
        return sum(len(s.tokens) for f in futs for s in f.result().sequences)

    def polyrl_group(sampler) -> int:
        futs = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        return sum(len(s.tokens) for f in futs for s in f.result().sequences)

    ids = torch.tensor([p for p in prompts for _ in range(args.group)], device=device)
    mask = torch.ones_like(ids)

    def hf_generate(model) -> int:
        def run() -> int:
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None)
            synchronize(device)
            return int((out.shape[1] - ids.shape[1]) * out.shape[0])

        return engine.call(run)  # on the engine's thread, like polyrl's sampling (see the module docstring)

    vllm_cases = {}
    if args.vllm:  # the same store, so the same checkpoint; an engine of its own that samples on vLLM
        from polyrl.local import ServiceClient

        vservice = ServiceClient(store_dir=root / "store", sampler="vllm")
        vllm_lora = vservice.create_sampling_client(model_path=ckpt).result()
        vllm_base = vservice.create_sampling_client(base_model=model_dir).result()
        vservice.engine._vllm[model_dir].wait_ready()
        vllm_cases = {"vllm n=1 x group, base": lambda: polyrl_n1(vllm_base),
                      "vllm n=group, base": lambda: polyrl_group(vllm_base),
                      "vllm n=1 x group, LoRA": lambda: polyrl_n1(vllm_lora),
                      "vllm n=group, LoRA": lambda: polyrl_group(vllm_lora)}
    cases = {
        **vllm_cases,
        "polyrl n=1 x group, base": lambda: polyrl_n1(base_sampler),
        "polyrl n=group, base": lambda: polyrl_group(base_sampler),
        "hf generate, base": lambda: hf_generate(hf),
        "polyrl n=1 x group, LoRA": lambda: polyrl_n1(lora_sampler),
        "polyrl n=group, LoRA": lambda: polyrl_group(lora_sampler),
        "hf generate, LoRA (PEFT)": lambda: hf_generate(hf_lora),
    }
    made = {}
    for key, fn in cases.items():  # warm-up (and check that every side makes the same number of tokens)
        made[key] = n = fn()
        # vLLM also stops at the tokenizer's end-of-sequence id: its rate is of the tokens it made
        assert n == total_new or (key.startswith("vllm") and n > total_new // 2), \
            f"{key}: expected {total_new} new tokens, got {n}"
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every case alike
        for key, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)

    print(f"model: {args.model or 'tiny base'} ({n_params / 1e6:.2f}M params), torch {torch.__version__}, "
          f"on {device} in {str(dtype).removeprefix('torch.')} (both sides), "
          f"{engine.call(torch.get_num_threads)} threads, {os.cpu_count()} CPUs")
    print(f"workload: {args.prompts} prompts x group {args.group} = {rows} rows, "
          f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens each ({total_new} tokens), "
          f"temperature 1, {args.repeats} interleaved runs")
    print(f"{'case':<28} {'median s':>9} {'tokens/s':>9} {'best s':>8} {'tokens/s':>9} {'CPU s':>7}")
    rate = {}
    for key, ts in times.items():
        t = statistics.median(ts)
        rate[key] = made[key] / min(ts)
        print(f"{key:<28} {t:9.3f} {made[key] / t:9.0f} {min(ts):8.3f} {rate[key]:9.0f} "
              f"{statistics.median(cpu[key]):7.3f}")
    for weights, hf_key in (("base", "hf generate, base"), ("LoRA", "hf generate, LoRA (PEFT)")):
        print(f"{weights} weights: polyrl / hf generate = "
              f"{rate[f'polyrl n=1 x group, {weights}'] / rate[hf_key]:.2f}x (n=1 x group), "
              f"{rate[f'polyrl n=group, {weights}'] / rate[hf_key]:.2f}x (n=group)")
    if args.vllm:
        def ratio(kind: str, weights: str) -> float:
            return rate[f"vllm {kind}, {weights}"] / rate[f"polyrl {kind}, {weights}"]

        for weights in ("base", "LoRA"):
            print(f"{weights} weights: vllm / polyrl = {ratio('n=1 x group', weights):.2f}x (n=1 x group), "
                  f"{ratio('n=group', weights):.2f}x (n=group)")
        sys.stdout.flush()
        print(f"vllm_vs_polyrl_sampler: {ratio('n=1 x group', 'LoRA'):.2f}x")
        return
    sys.stdout.flush()
    print(f"sampler_vs_hf_generate: {rate['polyrl n=1 x group, base'] / rate['hf generate, base']:.2f}x")


if __name__ == "__main__":
    main()
