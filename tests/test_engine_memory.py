"""How the local engine's passes use memory (:mod:`polyrl.local.allocator`): blocks freed inside a training
pass are reused from the heap (not fresh pages each time) and the heap's free pages go back to the OS when
the pass ends; a checkpointed model's pass keeps the fixed mmap threshold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl.local import allocator

pytestmark = [pytest.mark.skipif(sys.platform != "linux" or allocator.glibc() is None,
                                 reason="glibc's allocator settings"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

BLOCK = 1 << 20  # 1 MiB: above the fixed mmap threshold, below the pass's heap threshold

# In a fresh interpreter (a long-lived one's heap may hold free blocks from earlier work, which glibc hands
# out whatever the threshold): the minor page faults of 50 fresh 1 MiB blocks, each written and freed,
# inside a training pass (a custom loss runs on the engine's worker thread, within the pass), with the
# pass's heap, with the fixed threshold in its place, and for a checkpointed model; then the resident
# memory a pass leaves after freeing 64 MiB below a block that outlives it (a hole in the heap, not its
# top, which glibc trims by itself).
SCRIPT = """
import json, resource, sys
import psutil, torch
from polyrl.local import ServiceClient
from polyrl.local import allocator
from test_local_engine import random_datum

BLOCK = %d
service = ServiceClient(store_dir=sys.argv[2])
tc = service.create_lora_training_client(sys.argv[1], rank=4, seed=0).result()
datum = random_datum(torch.Generator().manual_seed(0), 8)
kept = []

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # fill_ runs on torch's threads too

def pass_faults():
    seen = {}
    def loss_fn(data, logprobs):
        before = faults()
        for _ in range(50):
            torch.empty(BLOCK // 4, dtype=torch.float32).fill_(1.0)
        seen["faults"] = faults() - before
        return -sum(lp.sum() for lp in logprobs), {}
    tc.forward_backward_custom([datum], loss_fn).result()
    return seen["faults"]

def hole(data, logprobs):
    blocks = [torch.empty(BLOCK // 4, dtype=torch.float32).fill_(1.0) for _ in range(64)]
    kept.append(torch.empty(BLOCK // 4, dtype=torch.float32).fill_(1.0))
    del blocks
    return -sum(lp.sum() for lp in logprobs), {}

result = {"heap": pass_faults()}
heap_bytes, allocator.PASS_HEAP_BLOCK_BYTES = allocator.PASS_HEAP_BLOCK_BYTES, allocator.LARGE_BLOCK_BYTES
result["fixed"] = pass_faults()
allocator.PASS_HEAP_BLOCK_BYTES = heap_bytes
tc._state.base.gradient_checkpointing = True
result["checkpointed"] = pass_faults()
tc._state.base.gradient_checkpointing = False
before = psutil.Process().memory_info().rss
tc.forward_backward_custom([datum], hole).result()
result["grown"] = psutil.Process().memory_info().rss - before
print(json.dumps(result))
""" % BLOCK


@pytest.fixture(scope="module")
def measured(tiny_model_dir, tmp_path_factory) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                       os.environ.get("PYTHONPATH", "")]))
    store = str(tmp_path_factory.mktemp("store"))
    out = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dir, store],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_training_pass_reuses_freed_blocks(measured):
    pages = BLOCK // 4096
    assert measured["fixed"] >= 40 * pages, measured  # every block fresh pages, under the fixed threshold
    assert measured["heap"] <= 5 * pages, measured  # the first block's pages, then the same ones again


def test_a_checkpointed_model_keeps_the_fixed_threshold(measured):
    assert measured["checkpointed"] >= 40 * (BLOCK // 4096), measured


def test_the_heap_gives_its_free_pages_back_after_a_pass(measured):
    assert measured["grown"] < 24 << 20, f"resident memory grew by {measured['grown'] >> 20} MiB"


def test_overlapping_passes_restore_the_fixed_threshold_when_the_last_ends(monkeypatch):
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append(("mallopt", param.value, value.value))

        def malloc_trim(self, pad):
            calls.append(("trim",))

    monkeypatch.setattr(allocator, "glibc", lambda: Libc())
    threshold = allocator.M_MMAP_THRESHOLD
    with allocator.heap_for_the_pass():
        with allocator.heap_for_the_pass():
            pass
        assert ("mallopt", threshold, allocator.LARGE_BLOCK_BYTES) not in calls  # the outer pass still runs
    assert [c for c in calls if c[0] == "mallopt"][-1] == ("mallopt", threshold, allocator.LARGE_BLOCK_BYTES)
    assert calls.count(("trim",)) == 2
    calls.clear()
    with allocator.heap_for_the_pass(enabled=False):
        pass
    assert calls == []
