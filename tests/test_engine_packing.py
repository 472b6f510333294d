"""The engine's optimisations against the plain computation: shared-prefix packing, chunked logits,
gradient checkpointing; and the guarantees around them (a failed call commits no gradient, datums
with different ``loss_fn_inputs`` keys each get exactly their own loss).

References are computed datum by datum through an independent Hugging Face + PEFT model loaded
from the same adapter checkpoint (``test_local_engine``'s helpers), so nothing here goes through
polyrl's packing or chunking.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_local_engine import (  # noqa: F401 - store and service are fixtures shared with that module
    adam,
    assert_grads_close,
    checkpoint_dir,
    from_state,
    load_reference,
    make_datum,
    out_logprobs,
    random_datum,
    ref_grads,
    ref_token_logprobs,
    reference_loss,
    service,
    store,
    take_grads,
    weights,
    with_inputs,
)
from tinker import types

from polyrl.local.compute import TargetLogprobs, packed_logprobs
from polyrl.local.packing import CPU_CALL_TOKENS, _tensors, group_rows, micro_batches, pack_rows

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def warm(service, store, tiny_model_dir):
    """A trained adapter (A and B nonzero, so every gradient is) and an independent reference model."""
    tc = service.create_lora_training_client(tiny_model_dir, rank=4, seed=3).result()
    gen = torch.Generator().manual_seed(1)
    data = [random_datum(gen, n) for n in (6, 10, 14)]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam(0.02))
    path = tc.save_state("warm").result().path
    return {"path": path, "ref": load_reference(tiny_model_dir, checkpoint_dir(store, path))}


def shared_prefix_batch(gen: torch.Generator, vocab: int = 700) -> list[types.Datum]:
    """GRPO-shaped groups (samples sharing a prompt), a multi-turn episode whose later datums extend
    the earlier ones, and unrelated short datums."""
    ints = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    seqs = []
    for prompt_len in (9, 15, 15):  # two groups with prompts of equal length but different tokens
        prompt = ints(prompt_len)
        seqs += [prompt + ints(int(torch.randint(1, 8, (1,), generator=gen))) for _ in range(4)]
    turn1 = ints(6) + ints(5)
    turn2 = turn1 + ints(4) + ints(3)
    seqs += [turn1, turn2, turn2 + ints(2) + ints(6)]
    seqs += [ints(3), ints(5), ints(2)]
    data = []
    for s in seqs:
        nxt = ints(1)
        data.append(make_datum(s, s[1:] + nxt))
    return data


def rl_inputs(tc, data, gen) -> list[types.Datum]:
    lps = out_logprobs(tc.forward(data, "cross_entropy").result())
    out = []
    for d, lp in zip(data, lps):
        adv = torch.randn(len(lp), generator=gen)
        adv[: len(lp) // 3] = 0.0
        out.append(with_inputs(d, logprobs=lp + 0.3 * torch.randn(len(lp), generator=gen), advantages=adv))
    return out


# ---- packing layout ----------------------------------------------------------------------------
def test_rows_share_prefixes_and_keep_each_datum_whole():
    rng = random.Random(0)
    for _ in range(50):
        seqs = []
        for _ in range(rng.randint(1, 6)):
            prompt = [rng.randrange(5) for _ in range(rng.randint(1, 12))]
            seqs += [prompt + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
                     for _ in range(rng.randint(1, 5))]
        seqs = [s for s in seqs if s]
        capacity = rng.randint(4, 40)
        rows = pack_rows(seqs, capacity)
        placed = sorted(d for r in rows for d in r.paths)
        assert placed == list(range(len(seqs)))
        for row in rows:
            assert len(row) <= max(capacity, max(len(s) for s in seqs))
            for d, path in row.paths.items():
                assert [row.tokens[p] for p in path] == seqs[d]
                assert [row.positions[p] for p in path] == list(range(len(seqs[d])))
                assert path == sorted(path)
        # nothing shared is stored twice within a row: packed tokens = distinct prefixes (trie nodes)
        for row in rows:
            prefixes = {tuple(seqs[d][: k + 1]) for d in row.paths for k in range(len(seqs[d]))}
            assert len(row) == len(prefixes)


def test_grpo_batch_packs_each_prompt_once():
    prompt_a, prompt_b = list(range(100, 292)), list(range(300, 492))
    seqs = [p + [7, k, 9] * 8 for p in (prompt_a, prompt_b) for k in range(8)]
    packed = sum(len(r) for r in pack_rows(seqs, 4096))
    assert packed == 2 * (192 + 1 + 8 * 23)  # each prompt once, and the completions' common first token
    separate = sum(len(s) for s in seqs)
    assert separate / packed > 4


def test_attention_mask_is_each_datums_own_causal_prefix():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [8, 9], [7]]
    rows = pack_rows(seqs, 64)
    assert [sorted(r.paths) for r in rows] == [[0, 1, 2], [3, 4]]  # the unrelated short ones share a row
    mb = _tensors(rows, "cpu")
    for r, row in enumerate(rows):
        attend = mb.attend[r, 0]
        for d, path in row.paths.items():
            for k, q in enumerate(path):
                assert {j for j in range(mb.input_ids.shape[1]) if attend[q, j]} == set(path[: k + 1])
        for q in range(len(row), mb.input_ids.shape[1]):  # padding sees only itself (no empty softmax row)
            assert {j for j in range(mb.input_ids.shape[1]) if attend[q, j]} == {q}


def test_rows_are_only_as_long_as_they_pay_for():
    """Unrelated datums share a row only up to the longest datum's length (attention over a longer row
    costs every token more than padding would); a shared prefix pays for a longer row, up to the point
    where the longer row's attention costs more than recomputing the prefix."""
    distinct = [[i] + [1000 + i] * 99 for i in range(8)]  # eight unrelated 100-token datums
    assert [len(r) for r in pack_rows(distinct, 4096)] == [100] * 8
    short = [[i, i] for i in range(30)] + [[99] * 20]
    assert max(len(r) for r in pack_rows(short, 4096)) == 20
    group = [[5] * 192 + [k] * 24 for k in range(8)]
    assert [len(r) for r in pack_rows(group, 4096, linear_per_pair=1000)] == [192 + 8 * 24]
    # a short shared prefix does not pay for a long row: each 208-token datum keeps its own
    few_shared = [[5] * 8 + [k] * 200 for k in range(8)]
    assert [len(r) for r in pack_rows(few_shared, 4096, linear_per_pair=1000)] == [208] * 8
    assert all(len(r) <= 64 for r in pack_rows(group, 64, linear_per_pair=1000) if len(r.paths) > 1)
    # attention along each datum's path costs a row its tokens whatever its length: rows fill to the budget
    assert [len(r) for r in pack_rows(few_shared, 4096, linear_per_pair=1000, tree=True)] == [8 + 8 * 200]
    assert [len(r) for r in pack_rows(few_shared, 600, linear_per_pair=1000, tree=True)] == [408] * 4
    assert [len(r) for r in pack_rows(distinct, 4096, tree=True)] == [800]
    assert [len(r) for r in pack_rows(distinct, 250, tree=True)] == [200] * 4


@pytest.mark.parametrize("overhead", [None, 0, 7, 40])
def test_micro_batches_cost_least(overhead):
    """Fewest micro-batches then least padding (``overhead=None``), or the least padded tokens plus
    ``overhead`` per micro-batch: against every way of cutting the length-sorted rows into runs, on small
    random batches."""
    import itertools

    def cost(batches, lengths):
        padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
        if overhead is None:
            return len(batches), padded
        return padded + overhead * len(batches), len(batches)

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 9))]
        budget = rng.randint(30, 200)
        got = group_rows(lengths, budget, overhead)
        assert sorted(i for b in got for i in b) == list(range(len(lengths)))
        assert all(len(b) == 1 or max(lengths[i] for i in b) * len(b) <= budget for b in got)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = None
        for r in range(len(order)):
            for cuts in itertools.combinations(range(1, len(order)), r):
                edges = [0, *cuts, len(order)]
                runs = [order[a:b] for a, b in zip(edges, edges[1:])]
                if all(len(b) == 1 or max(lengths[i] for i in b) * len(b) <= budget for b in runs):
                    best = min(best or cost(runs, lengths), cost(runs, lengths))
        assert cost(got, lengths) == best, (lengths, budget)


def test_a_cpu_micro_batch_does_not_pad_a_short_row_to_a_long_ones_width():
    """An RL step on SmolLM2 packed into rows of 831 and 143 tokens: one micro-batch of them computes
    1,662 tokens (2.4x a step of one row), two compute 974 and cost one more call."""
    rows = [[7] * 831, [8] * 143]  # two unrelated datums, each its own row
    on_cpu = micro_batches(rows, budget=4096, call_tokens=CPU_CALL_TOKENS)
    assert sorted(mb.tokens for mb in on_cpu) == [143, 831]
    assert [mb.tokens for mb in micro_batches(rows, budget=4096)] == [1662]  # where a call costs more (GPUs)


def test_the_engine_groups_rows_for_its_device(service, warm, monkeypatch):
    """The CPU engine passes the CPU's call cost to the grouping (a GPU engine passes none)."""
    tc = from_state(service, warm["path"])
    seen = []
    import polyrl.local.engine as engine_mod

    monkeypatch.setattr(engine_mod, "micro_batches",
                        lambda *a, **k: seen.append(k.get("call_tokens")) or micro_batches(*a, **k))
    tc.forward(shared_prefix_batch(torch.Generator().manual_seed(3)), "cross_entropy").result()
    assert seen == [CPU_CALL_TOKENS if tc._state.base.device.type == "cpu" else None]


def test_micro_batch_tokens_auto_is_the_cpu_default_and_grows_with_a_gpus_memory(monkeypatch):
    """``local.micro_batch_tokens: auto``: 4096 on a CPU; on a CUDA GPU 4096 per 20 GiB of its memory, at
    most 16384 (a GPU pass costs its launches more than its tokens). A number is taken as it is."""
    from types import SimpleNamespace

    from polyrl.local.engine import Engine
    from polyrl.local.packing import micro_batch_budget

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert micro_batch_budget("auto", cpu) == 4096 and micro_batch_budget(1000, cuda) == 1000
    for gib, want in ((8, 4096), (24, 4096), (40, 8192), (48, 8192), (80, 16384), (141, 16384)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, gib=gib: SimpleNamespace(total_memory=gib << 30))
        assert micro_batch_budget("auto", cuda) == want, gib
    engine = Engine(device="cpu")
    try:
        assert engine.micro_batch_tokens == 4096
    finally:
        engine.stop()
    for bad in (0, -5, "many", 2.0):
        with pytest.raises(ValueError, match="micro_batch_tokens must be a positive integer or 'auto'"):
            Engine(device="cpu", micro_batch_tokens=bad)


# ---- exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "gspo"])
def test_shared_prefix_packing_matches_separate_computation(service, warm, loss_fn):
    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(7)
    data = rl_inputs(tc, shared_prefix_batch(gen), gen)
    rows = pack_rows([d.model_input.to_ints() for d in data], 4096)
    assert sum(len(r) for r in rows) < 0.7 * sum(d.model_input.length for d in data)  # sharing happened

    out = tc.forward_backward(data, loss_fn).result()
    got_lps, got_grads = out_logprobs(out), take_grads(tc)

    ref = warm["ref"]
    with torch.no_grad():
        want_lps = [ref_token_logprobs(ref, d) for d in data]
    for got, want in zip(got_lps, want_lps):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    loss, coefs = reference_loss(loss_fn, [lp.double() for lp in want_lps], data, {})
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-5)
    assert_grads_close(got_grads, ref_grads(ref, data, coefs), rtol=1e-5)


def test_target_logprobs_give_autograds_own_values_and_gradients():
    """The one-buffer backward of target logprobs, against finite differences and log_softmax, with
    positions shared by several requests and one (position, target) pair asked twice."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    local = torch.tensor([0, 0, 2, 4, 4, 4, 1])
    targets = torch.tensor([3, 3, 0, 10, 1, 5, 7])
    assert torch.autograd.gradcheck(lambda x: TargetLogprobs.apply(x, local, targets), (logits,))
    coef = torch.randn(len(local), dtype=torch.float64, generator=gen)
    got = TargetLogprobs.apply(logits, local, targets)
    (got_grad,) = torch.autograd.grad((coef * got).sum(), logits)
    want = torch.log_softmax(logits, dim=-1)[local, targets]
    (want_grad,) = torch.autograd.grad((coef * want).sum(), logits)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)


def test_chunked_logits_equal_unchunked_in_value_and_gradient(service, warm, monkeypatch):
    """Chunked unembedding, with every chunk's logits recomputed in backward or the first ones kept, gives
    the values and gradients of one chunk; a recomputed chunk is unembedded twice, a kept one once."""
    tc = from_state(service, warm["path"])
    st, base = tc._state, tc._state.base
    gen = torch.Generator().manual_seed(9)
    data = shared_prefix_batch(gen)
    seqs = [d.model_input.to_ints() for d in data]
    (mb,) = micro_batches(seqs, budget=4096, device=base.device)
    targets = [data[i].loss_fn_inputs["target_tokens"].to_torch().long() for i in mb.datums]
    coef = [torch.randn(len(t), generator=gen).to(base.device) for t in targets]

    unembeddings = []
    real_logits = base.logits

    def counted_logits(hidden: torch.Tensor) -> torch.Tensor:
        unembeddings.append(len(hidden))
        return real_logits(hidden)

    monkeypatch.setattr(base, "logits", counted_logits)
    results = []
    row = 4 * base.vocab_size  # one position's float32 logits
    # one chunk; three positions per chunk, every chunk recomputed in backward; the first two kept
    for chunk_bytes, kept_bytes in ((1 << 40, None), (3 * row, 0), (3 * row, 7 * row)):
        unembeddings.clear()
        with base.use(st.adapter, train=True):
            lps = packed_logprobs(base, mb, targets, chunk_bytes=chunk_bytes, kept_bytes=kept_bytes)
            sum((c * lp).sum() for c, lp in zip(coef, lps)).backward()
        results.append(([lp.detach() for lp in lps], take_grads(tc), list(unembeddings)))
    (lp_a, g_a, once), *chunked = results
    positions = sum(once)
    assert len(once) == 1 and positions > 9
    chunks = -(-positions // 3)
    for (lp_b, g_b, calls), recomputed in zip(chunked, (chunks, chunks - 2)):
        assert len(calls) == chunks + recomputed and sum(calls[:chunks]) == positions
        for a, b in zip(lp_a, lp_b):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert_grads_close(g_b, g_a, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(service, warm):
    tc = from_state(service, warm["path"])
    base = tc._state.base
    gen = torch.Generator().manual_seed(13)
    data = rl_inputs(tc, shared_prefix_batch(gen), gen)
    grads, lps = [], []
    for on in (False, True):
        base.gradient_checkpointing = on
        try:
            lps.append(out_logprobs(tc.forward_backward(data, "ppo").result()))
        finally:
            base.gradient_checkpointing = False
        grads.append(take_grads(tc))
    for a, b in zip(*lps):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert_grads_close(grads[1], grads[0], rtol=1e-5)


def test_checkpointing_recomputes_blocks_in_backward(service, warm, monkeypatch):
    """With checkpointing on, each transformer block runs twice per training pass (forward and the
    backward's recomputation); with it off, once."""
    tc = from_state(service, warm["path"])
    base = tc._state.base
    inner = next(base._decoder_layers()[0].children())  # the recomputation calls the block's submodules
    calls = []
    handle = inner.register_forward_hook(lambda *a: calls.append(1))
    data = [random_datum(torch.Generator().manual_seed(2), 8)]
    try:
        for on, want in ((False, 1), (True, 2)):
            base.gradient_checkpointing = on
            calls.clear()
            tc.forward_backward(data, "cross_entropy").result()
            assert len(calls) == want
    finally:
        base.gradient_checkpointing = False
        handle.remove()
        take_grads(tc)


def test_auto_checkpointing_follows_model_size(tiny_model_dir):
    from polyrl.local.model import BaseModel

    assert BaseModel(tiny_model_dir).gradient_checkpointing is False  # tiny: activations are cheap
    assert BaseModel(tiny_model_dir, gradient_checkpointing=True).gradient_checkpointing is True


# ---- a call commits its gradients whole, or not at all ----------------------------------------
def test_failed_forward_backward_leaves_accumulated_gradients_untouched(service, warm, monkeypatch):
    import polyrl.local.engine as engine_mod

    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(17)
    first = [random_datum(gen, n) for n in (5, 9)]
    second = [random_datum(gen, n) for n in (6, 11, 13, 4)]
    tc.forward_backward(first, "cross_entropy").result()
    before = {n: p.grad.clone() for n, p in zip(range(len(tc._state.params)), tc._state.params)}

    calls = []
    real = engine_mod.packed_logprobs

    def fails_on_second_micro_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "packed_logprobs", fails_on_second_micro_batch)
    monkeypatch.setattr(service.engine, "micro_batch_tokens", 14)  # several micro-batches
    with pytest.raises(RuntimeError, match="simulated"):
        tc.forward_backward(second, "cross_entropy").result()
    assert len(calls) == 2  # micro-batch 1 ran its backward before micro-batch 2 failed
    monkeypatch.undo()
    after = {n: p.grad for n, p in zip(range(len(tc._state.params)), tc._state.params)}
    for n in before:
        assert torch.equal(before[n], after[n])

    # the queued optim_step applies exactly the first call's gradients
    tc.optim_step(adam(1e-2)).result()
    ref = from_state(service, warm["path"])
    ref.forward_backward(first, "cross_entropy").result()
    ref.optim_step(adam(1e-2)).result()
    wa, wb = weights(tc), weights(ref)
    for n in wa:
        torch.testing.assert_close(wa[n], wb[n], rtol=0, atol=1e-7)


# ---- datums with different loss_fn_inputs keys -------------------------------------------------
def test_datums_with_different_input_keys_each_get_their_own_loss(service, warm):
    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(19)
    plain = [random_datum(gen, n) for n in (5, 8, 6)]
    weighted = with_inputs(plain[1], weights=torch.rand(8, generator=gen))
    mixed = [plain[0], weighted, plain[2]]  # weights on the middle datum only

    got = tc.forward_backward(mixed, "cross_entropy").result()
    got_grads = take_grads(tc)
    ref = warm["ref"]
    with torch.no_grad():
        lps = [ref_token_logprobs(ref, d).double() for d in mixed]
    loss, coefs = reference_loss("cross_entropy", lps, mixed, {})
    assert got.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)
    assert_grads_close(got_grads, ref_grads(ref, mixed, coefs), rtol=1e-5)

    # GSPO with a sequence_ratio_mask on one datum: that datum's ratio uses its mask, the others
    # fall back to their nonzero-advantage tokens
    rl = rl_inputs(tc, plain, gen)
    rl[2] = with_inputs(rl[2], sequence_ratio_mask=[1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    got = tc.forward_backward(rl, "gspo").result()
    got_grads = take_grads(tc)
    with torch.no_grad():
        lps = [ref_token_logprobs(ref, d).double() for d in rl]
    loss, coefs = reference_loss("gspo", lps, rl, {})
    assert got.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert_grads_close(got_grads, ref_grads(ref, rl, coefs), rtol=1e-5)
