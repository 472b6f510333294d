"""Tree attention (polyrl.local.attention): packed rows attending along each datum's path give the dense
mask's outputs and gradients, in fewer query-key pairs."""

from __future__ import annotations

import torch

from polyrl.local.attention import PLAN, plan, tree_attention
from polyrl.local.model import select_device
from polyrl.local.packing import _tensors, group_rows, micro_batches, pack_rows

DEVICE = select_device()  # the engine's device: a GPU where there is one


def _batch():
    """Two GRPO-like groups (a shared prompt, completions of several lengths, one duplicate), and
    unrelated datums of several lengths: rows of different widths, so some positions are padding."""
    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(3, 500, (n,), generator=gen).tolist()

    sequences = []
    for prompt_len in (21, 9):
        prompt = tokens(prompt_len)
        completions = [tokens(n) for n in (5, 1, 12, 7)]
        sequences += [prompt + c for c in completions] + [prompt + completions[0]]  # the last: a duplicate
    sequences += [tokens(n) for n in (3, 30, 17)]
    return sequences


def _dense_and_tree(sequences, row_budget=64, batch_budget=4096, device="cpu"):
    """The same rows (as tree attention packs them, at most ``row_budget`` long) with a dense mask and with
    a plan: one micro-batch of rows of several widths (so some positions are padding)."""
    rows = pack_rows(sequences, row_budget, tree=True)
    groups = [[rows[i] for i in idx] for idx in group_rows([len(r) for r in rows], batch_budget)]
    assert any(len({len(r) for r in g}) > 1 for g in groups)
    return [_tensors(g, device) for g in groups], [_tensors(g, device, tree=True) for g in groups]


def _attention(mb, dtype, heads=6, kv_heads=2, dim=8, tree=True, seed=1, widen=False):
    """Attention over ``mb`` of seeded inputs in ``dtype`` (``widen``: those inputs computed in float32)."""
    rows, width = mb.input_ids.shape
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(rows, n, width, dim, generator=gen).to(mb.input_ids.device, dtype)
              for n in (heads, kv_heads, kv_heads)]
    q, k, v = ((x.float() if widen else x).requires_grad_() for x in inputs)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    extra = {PLAN: mb.plan} if tree else {}
    out, _ = tree_attention(module, q, k, v, mb.attend, scaling=dim**-0.5, **extra)
    return out, (q, k, v)


def test_tree_attention_gives_the_dense_masks_outputs_and_gradients():
    for dense_mb, tree_mb in zip(*_dense_and_tree(_batch(), device=DEVICE)):
        assert tree_mb.plan is not None and tree_mb.attend.shape[-2:] == (1, 1)  # no dense mask built
        want, want_in = _attention(dense_mb, torch.float32, tree=False)
        got, got_in = _attention(tree_mb, torch.float32)
        real = tree_mb.gather  # every datum token's packed position: what the loss reads
        flat = got.reshape(-1, *got.shape[2:])
        torch.testing.assert_close(flat[real], want.reshape(-1, *want.shape[2:])[real], rtol=1e-5, atol=1e-6)
        # a loss on the datum tokens: the same gradients for queries, keys and values
        weight = torch.randn(flat.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        (flat[real] * weight[real]).sum().backward()
        (want.reshape(flat.shape)[real] * weight[real]).sum().backward()
        for g, w in zip(got_in, want_in):
            torch.testing.assert_close(g.grad, w.grad, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got).all()  # padding positions get zeros, never NaN


def test_a_16_bit_input_attends_in_float32_on_a_cpu():
    [mb] = micro_batches(_batch()[:5], 64, tree=True)
    got, _ = _attention(mb, torch.bfloat16)
    wide, _ = _attention(mb, torch.bfloat16, widen=True)  # the same bfloat16 numbers, in float32
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, wide.to(torch.bfloat16))  # computed in float32, rounded once


def test_each_token_is_one_segments_query_and_buckets_pay_for_their_padding():
    [mb] = micro_batches(_batch(), 4096, tree=True)
    placed = torch.cat([b.queries[b.valid] for b in mb.plan.buckets])
    # every packed token of a datum is computed exactly once; padding positions by none
    assert sorted(placed.tolist()) == sorted(set(mb.gather.tolist()))
    assert mb.plan.inverse.shape == (mb.input_ids.numel(),)
    # a GRPO step's shape: 8 prompts of 40-56 tokens, 8 completions of 16 each
    gen = torch.Generator().manual_seed(3)
    sequences = []
    for g in range(8):
        prompt = torch.randint(3, 500, (40 + 2 * g,), generator=gen).tolist()
        sequences += [prompt + torch.randint(3, 500, (16,), generator=gen).tolist() for _ in range(8)]
    tree_pairs = dense_pairs = 0
    for mb in micro_batches(sequences, 4096, tree=True):
        tree_pairs += sum(b.mask.shape[0] * b.mask.shape[2] * b.mask.shape[3] for b in mb.plan.buckets)
        dense_pairs += mb.input_ids.numel() * mb.input_ids.shape[1]
    assert tree_pairs < 0.45 * dense_pairs, (tree_pairs, dense_pairs)


def test_a_row_of_one_datum_is_one_causal_segment():
    p = plan([{0: [0, 1, 2, 3]}], 4)
    [bucket] = p.buckets
    assert bucket.mask[0, 0].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    assert p.inverse.tolist() == [1, 2, 3, 4]
