"""Server overhead: one RL step through the tinker SDK and ``polyrl serve`` vs the same step in-process.

The step is what an RL loop does each iteration: ``--prompts`` x ``--group`` concurrent
``sample(num_samples=1)`` calls (a rollout), ``forward_backward`` with ``importance_sampling`` on
the sampled tokens, ``optim_step``, and ``save_weights_and_get_sampling_client`` for the next step.
Both sides use the ``base`` tiny model (built in a temporary directory) or ``--model DIR`` (its
end-of-sequence id removed so every sample runs to ``--new-tokens``), the same LoRA seed, seeded sampling
and the same advantages, so they do the same work. The server runs in a subprocess on 127.0.0.1; the
in-process side is ``polyrl.local.ServiceClient``. Steps alternate between the two sides (after warm-up); the
ratio is the median over steps of served / in-process time for the two runs of the same step, which
ran back to back (so a neighbour's load hits both alike). The machine is small and may be shared:
expect noise of several percent, and compare runs only on a quiet machine.

Both sides run torch with ``--threads`` threads (1 by default, see its help).

Run: ``.venv/bin/python benchmarks/serve_overhead.py [--steps 6] [--prompts 8 --group 8 --new-tokens 64]
[--threads 1]``.
The last line is ``serve_vs_inprocess: X.XXx`` (target: at most 1.15).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import add_model_arg, add_rollout_args, build_model  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")

API_KEY = "tml-benchmark"


def start_server(model: Path, store: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``polyrl serve`` of ``model`` on 127.0.0.1 with ``API_KEY`` and ``extra`` options: (process, URL)."""
    cmd = [sys.executable, "-m", "polyrl.serve", "--host", "127.0.0.1", "--port", "0", "--models", str(model),
           "--api-key", API_KEY, "--store-dir", str(store), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on" in line:
            return proc, line.rsplit(" ", 1)[-1].strip()
    proc.kill()
    raise SystemExit("polyrl serve did not start")


class Side:
    """One way of running the step: a service client, its training client and current sampler."""

    def __init__(self, name: str, service, args, model: Path):
        self.name = name
        self.service = service
        self.args = args
        self.model = model
        self.times: dict[str, list[float]] = {"sample": [], "train": [], "save": [], "step": []}

    async def setup(self) -> None:
        self.training = await self.service.create_lora_training_client(base_model=str(self.model),
                                                                       rank=self.args.rank, seed=0)
        self.sampler = await self.training.save_weights_and_get_sampling_client()

    async def step(self, step: int, prompts: list[list[int]], record: bool) -> list[list[int]]:
        from tinker import types

        a = self.args
        t0 = time.perf_counter()

        async def one(p: int, g: int):
            params = types.SamplingParams(max_tokens=a.new_tokens, temperature=1.0,
                                          seed=step * 100003 + p * 101 + g)
            return await self.sampler.sample(types.ModelInput.from_ints(prompts[p]), 1, params)

        results = await asyncio.gather(*(one(p, g) for p in range(a.prompts) for g in range(a.group)))
        t1 = time.perf_counter()
        datums, completions = [], []
        for i, res in enumerate(results):
            seq = res.sequences[0]
            prompt = prompts[i // a.group]
            tokens = prompt + list(seq.tokens)
            n_p, n = len(prompt), len(tokens) - 1
            adv = 1.0 if i % 2 else -1.0
            datums.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                    "logprobs": types.TensorData(data=[0.0] * (n_p - 1) + list(seq.logprobs),
                                                 dtype="float32", shape=[n]),
                    "advantages": types.TensorData(data=[0.0] * (n_p - 1) + [adv] * len(seq.tokens),
                                                   dtype="float32", shape=[n]),
                },
            ))
            completions.append(list(seq.tokens))
        fwd = self.training.forward_backward(datums, "importance_sampling")
        opt = self.training.optim_step(types.AdamParams(learning_rate=1e-3))
        await fwd
        await opt
        t2 = time.perf_counter()
        self.sampler = await self.training.save_weights_and_get_sampling_client()
        t3 = time.perf_counter()
        if record:
            for key, value in (("sample", t1 - t0), ("train", t2 - t1), ("save", t3 - t2), ("step", t3 - t0)):
                self.times[key].append(value)
        return completions


async def run(args) -> None:
    import random

    import tinker
    import torch

    from polyrl.local import ServiceClient as LocalServiceClient

    if args.threads:  # the same torch thread count on both sides
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root, args.model)
        proc, url = start_server(model, root / "store-served")
        try:
            rng = random.Random(0)
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
                       for _ in range(args.prompts)]
            inproc = Side("in-process", LocalServiceClient(store_dir=root / "store-inproc"), args, model)
            served = Side("served", tinker.ServiceClient(base_url=url, api_key=API_KEY), args, model)
            for side in (inproc, served):
                await side.setup()
            same = True
            for step in range(args.warmup + args.steps):
                record = step >= args.warmup
                order = (inproc, served) if step % 2 == 0 else (served, inproc)
                outs = {}
                for side in order:
                    outs[side.name] = await side.step(step, prompts, record)
                same = same and outs["in-process"] == outs["served"]
            print(f"RL step: {args.prompts} prompts x {args.group} samples x {args.new_tokens} new tokens, "
                  f"prompt {args.prompt_tokens} tokens, LoRA rank {args.rank}, "
                  f"model {args.model or 'tiny base'}, "
                  f"torch threads {args.threads or torch.get_num_threads()}; "
                  f"{args.steps} steps each, alternating (after {args.warmup} warm-up)")
            print(f"same samples on both sides: {same}")
            for side in (inproc, served):
                parts = "  ".join(f"{k} {statistics.median(v) * 1000:7.1f} ms" for k, v in side.times.items())
                print(f"{side.name:>11}: {parts}   "
                      f"(steps: {', '.join(f'{t * 1000:.0f}' for t in side.times['step'])} ms)")
            pairs = [b / a for a, b in zip(inproc.times["step"], served.times["step"])]
            medians = statistics.median(served.times["step"]) / statistics.median(inproc.times["step"])
            print(f"ratio of medians: {medians:.2f}x; "
                  f"per step pair: {', '.join(f'{r:.2f}' for r in pairs)}")
            print(f"serve_vs_inprocess: {statistics.median(pairs):.2f}x")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rollout_args(ap)
    add_model_arg(ap)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads on both sides (0: torch's default). 1 by default: on a small shared "
                         "machine, multi-threaded torch stalls whenever a neighbour preempts one of its "
                         "threads, which swamps the overhead being measured")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
