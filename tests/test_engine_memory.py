"""How the local engine's passes use memory: blocks freed inside a training pass are reused from the heap
(not fresh pages each time) and the heap's free pages go back to the OS when the pass ends; a checkpointed
model's pass keeps the fixed mmap threshold."""

from __future__ import annotations

import resource
import sys

import psutil
import pytest
import torch

from polyrl.local import engine as engine_mod
from test_local_engine import random_datum, service, store  # noqa: F401 - fixtures shared with that module

pytestmark = [pytest.mark.skipif(sys.platform != "linux" or engine_mod._glibc() is None,
                                 reason="glibc's allocator settings"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

BLOCK = 1 << 20  # 1 MiB: above the fixed mmap threshold, below the pass's heap threshold
KEPT: list[torch.Tensor] = []  # a block that outlives the pass (then dropped by the test)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # fill_ runs on torch's threads too


def _pass_faults(tc) -> int:
    """Minor page faults of 50 fresh 1 MiB blocks, each written and freed, inside a training pass (a custom
    loss runs on the engine's worker thread, within the pass)."""
    seen = {}

    def loss_fn(data, logprobs):
        before = _faults()
        for _ in range(50):
            torch.empty(BLOCK // 4, dtype=torch.float32).fill_(1.0)
        seen["faults"] = _faults() - before
        return -sum(lp.sum() for lp in logprobs), {}

    tc.forward_backward_custom([random_datum(torch.Generator().manual_seed(0), 8)], loss_fn).result()
    return seen["faults"]


def test_a_training_pass_reuses_freed_blocks(service, tiny_model_dir, monkeypatch):
    tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    pages = BLOCK // 4096
    reused = _pass_faults(tc)
    monkeypatch.setattr(engine_mod, "PASS_HEAP_BLOCK_BYTES", engine_mod.LARGE_BLOCK_BYTES)
    fixed = _pass_faults(tc)
    assert fixed >= 40 * pages, fixed  # every block fresh pages, under the fixed threshold
    assert reused <= 5 * pages, (reused, fixed)  # the first block's pages, then the same ones again


def test_a_checkpointed_model_keeps_the_fixed_threshold(service, tiny_model_dir):
    tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    tc._state.base.gradient_checkpointing = True
    try:
        assert _pass_faults(tc) >= 40 * (BLOCK // 4096)
    finally:
        tc._state.base.gradient_checkpointing = False


def test_the_heap_gives_its_free_pages_back_after_a_pass(service, tiny_model_dir):
    """64 MiB freed inside a pass, below a block that outlives it (so the free space is a hole in the
    heap, not its top, which glibc trims by itself): resident memory is back when the pass ends."""
    tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=0).result()
    datum = random_datum(torch.Generator().manual_seed(0), 8)

    def loss_fn(data, logprobs):
        blocks = [torch.empty(BLOCK // 4, dtype=torch.float32).fill_(1.0) for _ in range(64)]
        KEPT.append(torch.empty(BLOCK // 4, dtype=torch.float32).fill_(1.0))
        del blocks
        return -sum(lp.sum() for lp in logprobs), {}

    tc.forward_backward_custom([datum], lambda d, lps: (-sum(lp.sum() for lp in lps), {})).result()
    before = psutil.Process().memory_info().rss
    try:
        tc.forward_backward_custom([datum], loss_fn).result()
        grown = psutil.Process().memory_info().rss - before
    finally:
        KEPT.clear()
    assert grown < 24 << 20, f"resident memory grew by {grown >> 20} MiB"


def test_overlapping_passes_restore_the_fixed_threshold_when_the_last_ends(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append(("mallopt", param.value, value.value))

        def malloc_trim(self, pad):
            calls.append(("trim",))

    monkeypatch.setattr(engine_mod, "_glibc", lambda: Libc())
    threshold = engine_mod.M_MMAP_THRESHOLD
    with engine_mod._heap_for_the_pass():
        with engine_mod._heap_for_the_pass():
            pass
        assert ("mallopt", threshold, engine_mod.LARGE_BLOCK_BYTES) not in calls  # the outer pass still runs
    assert [c for c in calls if c[0] == "mallopt"][-1] == ("mallopt", threshold, engine_mod.LARGE_BLOCK_BYTES)
    assert calls.count(("trim",)) == 2
    calls.clear()
    with engine_mod._heap_for_the_pass(enabled=False):
        pass
    assert calls == []
