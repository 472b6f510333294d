"""Fairness of a shared ``polyrl serve``: key B's small sampling request while key A floods the engine.

Key B asks for 1 sample of ``--small-tokens`` tokens, one request at a time, ``--repeats`` times: first
with the server otherwise idle, then while key A keeps the engine busy with requests of ``--flood-samples``
samples x ``--flood-tokens`` tokens (always ``--flood-requests`` of them in flight, re-sent as each ends).
Both keys sample from LoRA snapshots of their own (the same sampling slot, so every turn swaps weights).
Samples run to their ``max_tokens`` (the model's end-of-sequence id is removed). The server runs in a
subprocess on 127.0.0.1; both keys talk to it through the official tinker SDK, from this process.

Before the engine shared itself between keys, B's request waited for A's whole decode (thousands of
steps); now it waits for at most one slice of it (``SLICE_S``, longer only when resuming a decode is
costly) per turn.

Run: ``.venv/bin/python benchmarks/serve_fairness.py [--model DIR] [--repeats 12] [--flood-samples 64
--flood-tokens 1000 --flood-requests 2] [--small-tokens 4]``.
The last line is ``serve_fairness_flooded_vs_alone: X.XXx``: B's median latency while A floods over its
median latency alone (lower is better; the bar is at most 3x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import add_model_arg, build_model  # noqa: E402
from serve_overhead import start_server  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
KEYS = ("tml-fairness-a", "tml-fairness-b")


def sampler(service, model: Path, seed: int):
    """A sampling client of a LoRA with nonzero weights (one step of training on a made-up datum)."""
    from tinker import types

    tc = service.create_lora_training_client(base_model=str(model), rank=8, seed=seed)
    tokens = list(range(5, 37))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc.save_weights_and_get_sampling_client()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arg(ap)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--flood-samples", type=int, default=64)
    ap.add_argument("--flood-tokens", type=int, default=1000)
    ap.add_argument("--flood-requests", type=int, default=2)
    ap.add_argument("--small-tokens", type=int, default=4)
    args = ap.parse_args()

    import tinker
    from tinker import types

    from polyrl.local.engine import SLICE_S

    root = Path(tempfile.mkdtemp(prefix="polyrl-fairness-"))
    model = build_model(root, args.model)
    proc, url = start_server(model, root / "store", *(a for key in KEYS for a in ("--api-key", key)))
    try:
        a_service, b_service = (tinker.ServiceClient(base_url=url, api_key=key) for key in KEYS)
        a_sampler, b_sampler = sampler(a_service, model, 1), sampler(b_service, model, 2)
        prompt = types.ModelInput.from_ints(list(range(5, 37)))

        def small() -> float:
            t0 = time.perf_counter()
            out = b_sampler.sample(prompt, 1, types.SamplingParams(max_tokens=args.small_tokens)).result()
            assert len(out.sequences[0].tokens) == args.small_tokens
            return time.perf_counter() - t0

        small()  # warm-up
        alone = [small() for _ in range(args.repeats)]

        stop = threading.Event()
        flooded_steps = [0]

        def flood() -> None:
            params = types.SamplingParams(max_tokens=args.flood_tokens, temperature=1.0)
            while not stop.is_set():
                a_sampler.sample(prompt, args.flood_samples, params).result()
                flooded_steps[0] += args.flood_tokens

        threads = [threading.Thread(target=flood, daemon=True) for _ in range(args.flood_requests)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # A's decodes are under way
        flooded = [small() for _ in range(args.repeats)]
        stop.set()
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        proc.wait(30)

    def row(name: str, times: list[float]) -> str:
        return f"{name:<30} {statistics.median(times) * 1000:>9.1f} {min(times) * 1000:>9.1f} " \
               f"{max(times) * 1000:>9.1f}"

    print(f"key B: 1 sample x {args.small_tokens} tokens; key A: {args.flood_requests} x "
          f"{args.flood_samples} samples x {args.flood_tokens} tokens in flight; slice {SLICE_S * 1000:g} ms")
    print(f"{'B latency (ms)':<30} {'median':>9} {'best':>9} {'worst':>9}")
    print(row("alone", alone))
    print(row("while A floods", flooded))
    print(f"A decoded {flooded_steps[0]} steps' worth of tokens per row meanwhile")
    print(f"serve_fairness_flooded_vs_alone: {statistics.median(flooded) / statistics.median(alone):.2f}x")


if __name__ == "__main__":
    main()
