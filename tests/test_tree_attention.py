"""Tree and flex attention (polyrl.local.attention): packed rows attending along each datum's path give the
dense mask's outputs and gradients, in fewer query-key pairs; and the ``local.attention`` setting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyrl.errors import UserInputError
from polyrl.local.attention import PLAN, flex_tree, flex_tree_attention, plan, tree_attention
from polyrl.local.compute import packed_logprobs
from polyrl.local.model import BaseModel, LoraSpec, select_device
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


def _multi_turn():
    """An episode's datums: the first turn, the first answer after it, and two second turns after that answer
    (a path that shares a prefix, then diverges, and its sibling): a trie three levels deep."""
    gen = torch.Generator().manual_seed(4)

    def tokens(n):
        return torch.randint(3, 500, (n,), generator=gen).tolist()

    turn = tokens(10)
    answered = turn + tokens(5)
    return [turn, answered, answered + tokens(4) + tokens(3), answered + tokens(6)]


def _dense_and_tree(sequences, row_budget=64, batch_budget=4096, device="cpu", flex=False):
    """The same rows (as tree attention packs them, at most ``row_budget`` long) with a dense mask and with
    a plan (``flex``: a FlexTree): one micro-batch of rows of several widths (so some positions are
    padding)."""
    rows = pack_rows(sequences, row_budget, tree=True)
    groups = [[rows[i] for i in idx] for idx in group_rows([len(r) for r in rows], batch_budget)]
    assert any(len({len(r) for r in g}) > 1 for g in groups)
    return [_tensors(g, device) for g in groups], [_tensors(g, device, tree=True, flex=flex) for g in groups]


def _attention(mb, dtype, heads=6, kv_heads=2, dim=8, tree=True, seed=1, widen=False, fn=tree_attention):
    """Attention over ``mb`` of seeded inputs in ``dtype`` (``widen``: those inputs computed in float32)
    through ``fn``, along the micro-batch's plan (``tree``) or under its dense mask; the inputs require
    gradients where gradients are enabled."""
    rows, width = mb.input_ids.shape
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(rows, n, width, dim, generator=gen).to(mb.input_ids.device, dtype)
              for n in (heads, kv_heads, kv_heads)]
    q, k, v = ((x.float() if widen else x).requires_grad_(torch.is_grad_enabled()) for x in inputs)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    extra = {PLAN: mb.plan} if tree else {}
    out, _ = fn(module, q, k, v, mb.attend, scaling=dim**-0.5, **extra)
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


# ---- flex attention ----------------------------------------------------------------------------------
def test_a_rows_trie_is_numbered_depth_first():
    # datums 0 and 1 share positions 0-1, then branch (2, 3); datum 2 is a tree of its own; 5 is padding
    tree = flex_tree([{0: [0, 1, 2], 1: [0, 1, 3], 2: [4]}], 6)
    assert tree.enter.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert tree.exit.tolist() == [[4, 4, 3, 4, 5, 6]]
    # the walk follows the paths, not the packed order: here position 2 is entered before position 1
    tree = flex_tree([{0: [0, 2], 1: [0, 1]}], 4)
    assert (tree.enter.tolist(), tree.exit.tolist()) == ([[0, 2, 1, 3]], [[3, 3, 2, 4]])


def test_the_flex_trees_mask_is_the_dense_mask():
    """Datum tokens attend to exactly their own datum's path, padding to itself only: pair for pair."""
    for dense_mb, flex_mb in zip(*_dense_and_tree(_batch() + _multi_turn(), flex=True)):
        assert flex_mb.attend.shape[-2:] == (1, 1)  # no dense mask built with the rows
        assert torch.equal(flex_mb.plan.dense_mask(), dense_mb.attend)


def test_flex_attention_gives_the_dense_masks_outputs_and_gradients():
    """Without gradients, FlexAttention's own computation (uncompiled on a CPU, compiled on CUDA); with them,
    CUDA's kernel or, on a CPU, the tree's mask through SDPA: the dense mask's outputs and gradients."""
    for dense_mb, flex_mb in zip(*_dense_and_tree(_batch() + _multi_turn(), device=DEVICE, flex=True)):
        want, want_in = _attention(dense_mb, torch.float32, tree=False)
        with torch.no_grad():
            kernel, _ = _attention(flex_mb, torch.float32, fn=flex_tree_attention)
        got, got_in = _attention(flex_mb, torch.float32, fn=flex_tree_attention)
        real = flex_mb.gather
        flat = got.reshape(-1, *got.shape[2:])
        for out in (kernel, got):
            assert torch.isfinite(out).all()  # padding positions too
            torch.testing.assert_close(out.reshape(flat.shape)[real], want.reshape(flat.shape)[real],
                                       rtol=1e-5, atol=1e-6)
        weight = torch.randn(flat.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        (flat[real] * weight[real]).sum().backward()
        (want.reshape(flat.shape)[real] * weight[real]).sum().backward()
        for g, w in zip(got_in, want_in):
            torch.testing.assert_close(g.grad, w.grad, rtol=1e-5, atol=1e-5)


def test_flex_attention_of_16_bit_inputs_computes_in_float32_on_a_cpu():
    [mb] = micro_batches(_batch()[:5], 64, tree=True, flex=True)
    for grad in (False, True):  # FlexAttention's computation; the dense mask through SDPA
        with torch.set_grad_enabled(grad):
            got, _ = _attention(mb, torch.bfloat16, fn=flex_tree_attention)
            wide, _ = _attention(mb, torch.bfloat16, widen=True, fn=flex_tree_attention)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, wide.to(torch.bfloat16))  # computed in float32, rounded once


def test_flex_attention_gives_the_models_dense_logprobs_loss_and_lora_gradients(tiny_model_dir, monkeypatch):
    """The tiny model (2 query heads on 1 KV head) with a LoRA adapter, every weight of it nonzero, over
    packed micro-batches of GRPO-like groups, a branching episode and unrelated datums (rows of several
    widths): each token's logprob (with and without gradients), the loss and every LoRA gradient, against
    the same rows under the dense mask. The block mask is built once a micro-batch, not once a layer."""
    sequences = _batch() + _multi_turn()
    gen = torch.Generator().manual_seed(5)
    targets = [torch.randint(3, 500, (len(s),), generator=gen).to(DEVICE) for s in sequences]
    coefs = [torch.randn(len(s), generator=gen).to(DEVICE) for s in sequences]
    import sys

    import torch.nn.attention.flex_attention as flex  # polyrl.local.attention imports from it where used

    built: list[str] = []  # the masks polyrl's attention built (not those PyTorch builds on the way)

    def counted(real, name):
        def build(*args, **kwargs):
            if sys._getframe(1).f_globals["__name__"] == "polyrl.local.attention":
                built.append(name)
            return real(*args, **kwargs)
        return build

    for name in ("create_block_mask", "create_mask"):
        monkeypatch.setattr(flex, name, counted(getattr(flex, name), name))
    batches = dict(zip(("dense", "flex"), _dense_and_tree(sequences, device=DEVICE, flex=True)))
    results = {}
    for kind, mbs in batches.items():
        base = BaseModel(tiny_model_dir, str(DEVICE), "float32", attention=kind)
        assert base.attention == kind
        base.add_adapter("a", LoraSpec(4, seed=3))
        weights = torch.Generator().manual_seed(6)
        with torch.no_grad():
            for p in base.adapter_params("a"):
                p.copy_(0.1 * torch.randn(p.shape, generator=weights))
        lps, plain, loss = {}, {}, 0.0
        with base.use("a", train=True):
            for mb in mbs:
                wanted = [targets[d] for d in mb.datums]
                with torch.no_grad():
                    plain.update(zip(mb.datums, packed_logprobs(base, mb, wanted)))
                got = packed_logprobs(base, mb, wanted)
                lps.update(zip(mb.datums, (lp.detach() for lp in got)))
                mb_loss = sum((coefs[d] * lp).sum() for d, lp in zip(mb.datums, got))
                mb_loss.backward()
                loss += float(mb_loss.detach())
        results[kind] = lps, plain, loss, [p.grad for p in base.adapter_params("a")]
    (lps, plain, loss, grads), (flex_lps, flex_plain, flex_loss, flex_grads) = results.values()
    assert sorted(lps) == sorted(flex_lps) == list(range(len(sequences)))
    for d in lps:
        torch.testing.assert_close(flex_lps[d], lps[d], rtol=0, atol=1e-5)
        torch.testing.assert_close(flex_plain[d], plain[d], rtol=0, atol=1e-5)
    assert flex_loss == pytest.approx(loss, rel=1e-5, abs=1e-5)
    assert len(grads) == len(flex_grads) > 0
    for g, w in zip(flex_grads, grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # each micro-batch's first layer builds what the others use: with gradients on a CPU, the dense mask
    flex_batches = len(batches["flex"])
    assert built.count("create_block_mask") == flex_batches
    assert built.count("create_mask") == (0 if DEVICE.type == "cuda" else flex_batches)


def test_the_local_attention_setting(tiny_model_dir, tmp_path, monkeypatch):
    from polyrl.config.files import load_config
    from polyrl.config.schema import ConfigError

    monkeypatch.chdir(tmp_path)  # no stray .env
    config = {"model_name": "tiny", "environments": {"arithmetic": {}}}
    assert load_config(None, [], base=config).local.attention == "auto"
    assert load_config(None, ["local.attention=flex"], base=config).local.attention == "flex"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["local.attention=fast"], base=config)
    assert str(info.value) == "local.attention: Input should be 'auto', 'dense', 'tree' or 'flex'"
    # auto is as before: tree attention on a CPU
    assert BaseModel(tiny_model_dir, "cpu", "float32").attention == "tree"
    # a model with a sliding window cannot attend along paths: auto keeps the dense mask, flex is refused
    windowed = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir, windowed)
    settings = json.loads((windowed / "config.json").read_text())
    settings.update(use_sliding_window=True, sliding_window=8,
                    layer_types=["full_attention", "sliding_attention"])
    (windowed / "config.json").write_text(json.dumps(settings))
    assert BaseModel(str(windowed), "cpu", "float32").attention == "dense"
    with pytest.raises(UserInputError, match="local.attention 'flex': model .* cannot attend along packed "
                       "datums' paths"):
        BaseModel(str(windowed), "cpu", "float32", attention="flex")


def test_local_attention_reaches_the_engine_through_the_service_client(tiny_model_dir, tmp_path):
    """``ServiceClient(attention=...)`` (what ``local.attention`` and ``polyrl serve --attention`` set): a
    flex engine packs its micro-batches with the rows' trie and gives the dense engine's logprobs."""
    from tinker import types

    from polyrl.local import ServiceClient

    tokens = [list(range(5, 20)), list(range(5, 12)) + [40, 41, 42], list(range(30, 38))]
    data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=t[1:], dtype="int64")})
            for t in tokens]
    logprobs = {}
    for choice in ("dense", "flex"):
        service = ServiceClient(store_dir=tmp_path / choice, device="cpu", dtype="float32", attention=choice)
        training = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
        assert service.engine.base(tiny_model_dir).attention == choice
        out = training.forward(data, "cross_entropy").result()
        logprobs[choice] = [o["logprobs"].data for o in out.loss_fn_outputs]
    for dense, flex in zip(logprobs["dense"], logprobs["flex"], strict=True):
        assert flex == pytest.approx(dense, abs=1e-5)
