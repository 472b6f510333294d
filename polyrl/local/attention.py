"""The learner's attention implementations, registered with Hugging Face's attention interface.

* :func:`float32_attention`: SDPA computed in float32 for 16-bit inputs, the output cast back (a 16-bit
  learner on a CPU, where PyTorch's bfloat16 flash-attention backward runs at half its float32 speed).
* :func:`tree_attention`: attention over packed rows along each datum's own path, without a dense mask.

A packed row (:mod:`polyrl.local.packing`) holds a tree of datums: a GRPO group's prompt once, then each
completion, every token attending to its own datum's tokens before it. A dense ``[rows, 1, width, width]``
mask computes every pair of the row and throws most away: a group of 8 completions of 16 tokens after a
48-token prompt is a 176-token row of 31,000 pairs, of which 8,400 are needed (a completion's token
attends to at most 64 keys).

Tree attention makes each datum's new tokens (those no datum before it in the row laid down) one segment:
its queries attend to the datum's whole path, causally. Segments of like shape go into one bucket, padded
to its longest query and key run, and each bucket is one ``scaled_dot_product_attention`` call over
gathered queries, keys and values (:class:`AttentionPlan`, built with the rows). Every packed token
belongs to exactly one segment, so the outputs put back in packed order are the dense mask's, pair for
pair. A call without a plan (the sampler's prefill, a decode step) is plain SDPA over its mask, in float32
on a CPU for 16-bit inputs.

:func:`flex_tree_attention` computes the same pairs with PyTorch's FlexAttention. A row's tokens form a trie
(each token's parent is the token before it on its datum's path), and a token attends to a key exactly
when the key is the token or one of its ancestors. A depth-first walk numbers each token on entering it
and notes the number after its last descendant (:class:`FlexTree`, built with the rows), so that test is
two comparisons of ``[rows, width]`` integers, which FlexAttention's block mask evaluates. On CUDA
FlexAttention is compiled (a block-sparse kernel); elsewhere it runs uncompiled, and a pass that needs
gradients (FlexAttention has no backward on a CPU) runs the same test as a dense mask through SDPA.
"""

from __future__ import annotations

import bisect
import functools
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # FlexAttention is imported where it is used: it costs ~0.3 s of every engine's start
    from torch.nn.attention.flex_attention import BlockMask

FLOAT32_ATTENTION = "polyrl_sdpa_float32"  # a 16-bit learner's attention on a CPU (registered on use)
TREE_ATTENTION = "polyrl_tree"
FLEX_ATTENTION = "polyrl_flex"
PLAN = "polyrl_attention_plan"  # the keyword that carries a micro-batch's plan (or FlexTree) down
# Padding a bucket may add, as a share of its real query-key pairs, before a segment starts a new bucket;
# and what one more bucket costs, in pairs (a call per layer and pass, and its gathers).
BUCKET_WASTE = 0.5
BUCKET_CALL_PAIRS = 4096


@dataclass
class Bucket:
    """Segments of one padded shape: ``S`` segments of at most ``Q`` queries and ``K`` keys."""

    queries: torch.Tensor  # [S * Q] flat packed position of each query slot (padding slots: 0)
    keys: torch.Tensor  # [S * K] flat packed position of each key slot (padding slots: 0)
    mask: torch.Tensor  # [S, 1, Q, K] bool: query attends to key (a padding query attends to key 0)
    valid: torch.Tensor  # [n] the query slots that hold a token, in ``S * Q`` order


@dataclass
class AttentionPlan:
    buckets: list[Bucket]
    inverse: torch.Tensor  # [rows * width] each packed position's place in the buckets' outputs (0: padding)

    def to(self, device) -> AttentionPlan:
        return AttentionPlan([Bucket(*(t.to(device) for t in (b.queries, b.keys, b.mask, b.valid)))
                              for b in self.buckets], self.inverse.to(device))


@dataclass
class _Segment:
    queries: list[int]  # flat packed positions of the datum's new tokens
    keys: list[int]  # flat packed positions of the datum's whole path
    offset: int  # the path index of the first query


def plan(paths: list[dict[int, list[int]]], width: int) -> AttentionPlan:
    """The plan of rows of ``width`` whose datums lie at ``paths`` (per row: datum -> packed index of each
    of its tokens, in the order the datums were laid down)."""
    segments = []
    for r, row_paths in enumerate(paths):
        claimed: set[int] = set()
        for path in row_paths.values():
            offset = next((i for i, p in enumerate(path) if p not in claimed), len(path))
            if offset == len(path):  # a duplicate of a datum before it: nothing new to compute
                continue
            base = r * width
            segments.append(_Segment([base + p for p in path[offset:]], [base + p for p in path], offset))
            claimed.update(path[offset:])
    segments.sort(key=lambda s: (len(s.queries), len(s.keys)))  # completions apart from prompts
    groups: list[list[_Segment]] = []
    real = q_max = k_max = 0  # the last group's real pairs and padded shape
    for seg in segments:
        q, k = len(seg.queries), len(seg.keys)
        if groups and ((len(groups[-1]) + 1) * max(q_max, q) * max(k_max, k) - (real + q * k)
                       <= BUCKET_WASTE * (real + q * k) + BUCKET_CALL_PAIRS):
            groups[-1].append(seg)
            real, q_max, k_max = real + q * k, max(q_max, q), max(k_max, k)
        else:
            groups.append([seg])
            real, q_max, k_max = q * k, q, k
    inverse = torch.zeros(len(paths) * width, dtype=torch.long)
    buckets, placed = [], 0
    for group in groups:
        q_max, k_max = max(len(s.queries) for s in group), max(len(s.keys) for s in group)
        queries = torch.zeros((len(group), q_max), dtype=torch.long)
        keys = torch.zeros((len(group), k_max), dtype=torch.long)
        q_len, k_len, offset = (torch.tensor(values).view(-1, 1, 1) for values in zip(
            *((len(s.queries), len(s.keys), s.offset) for s in group)))  # [S, 1, 1] each
        for i, s in enumerate(group):
            queries[i, : len(s.queries)] = torch.tensor(s.queries)
            keys[i, : len(s.keys)] = torch.tensor(s.keys)
        i = torch.arange(q_max).view(1, -1, 1)
        j = torch.arange(k_max).view(1, 1, -1)
        real = i < q_len  # [S, Q, 1]
        mask = (real & (j < k_len) & (j <= offset + i)) | (~real & (j == 0))  # [S, Q, K]
        valid = real.reshape(-1).nonzero().squeeze(1)
        inverse[queries.reshape(-1)[valid]] = torch.arange(placed + 1, placed + 1 + len(valid))
        placed += len(valid)
        buckets.append(Bucket(queries.reshape(-1), keys.reshape(-1), mask.unsqueeze(1), valid))
    return AttentionPlan(buckets, inverse)


@dataclass
class FlexTree:
    """Each packed position's place in a depth-first walk of its row's trie: ``kv`` is ``q`` or one of its
    ancestors exactly when ``enter[kv] <= enter[q] < exit[kv]``. The masks are built on a pass's first
    layer and kept for its other layers (and for a recomputing backward)."""

    enter: torch.Tensor  # [rows, width] int32: the position's number in the walk
    exit: torch.Tensor  # [rows, width] int32: the number after its last descendant's
    _block: BlockMask | None = field(default=None, repr=False)
    _dense: torch.Tensor | None = field(default=None, repr=False)

    def to(self, device) -> FlexTree:
        return FlexTree(self.enter.to(device), self.exit.to(device))

    def mask_mod(self):
        enter, exit_ = self.enter, self.exit

        def ancestor_or_self(b, h, q, kv):
            return (enter[b, kv] <= enter[b, q]) & (enter[b, q] < exit_[b, kv])

        return ancestor_or_self

    def block_mask(self) -> BlockMask:
        from torch.nn.attention.flex_attention import create_block_mask

        if self._block is None:
            rows, width = self.enter.shape
            self._block = create_block_mask(self.mask_mod(), rows, None, width, width, self.enter.device)
        return self._block

    def dense_mask(self) -> torch.Tensor:
        """``[rows, 1, width, width]`` bool: the same test for every pair."""
        from torch.nn.attention.flex_attention import create_mask

        if self._dense is None:
            rows, width = self.enter.shape
            self._dense = create_mask(self.mask_mod(), rows, None, width, width, self.enter.device)
        return self._dense


def flex_tree(paths: list[dict[int, list[int]]], width: int) -> FlexTree:
    """The :class:`FlexTree` of rows of ``width`` whose datums lie at ``paths`` (as for :func:`plan`). Every
    position on no path (padding) is numbered after the row's tokens, a leaf of its own: it attends to
    itself only, so no attention row is empty."""
    enter = torch.empty((len(paths), width), dtype=torch.int32)
    exit_ = torch.empty_like(enter)
    for r, row_paths in enumerate(paths):
        children: dict[int, list[int]] = {-1: []}  # -1: the root above every datum's first token
        for path in row_paths.values():
            # the positions an earlier datum placed are a prefix of the path (a trie)
            start = bisect.bisect_left(path, True, key=lambda p: p not in children)
            parent = path[start - 1] if start else -1
            for p in path[start:]:
                children[p] = []
                children[parent].append(p)
                parent = p
        order, stack = [], children[-1][::-1]  # positions in the walk's order
        while stack:
            p = stack.pop()
            order.append(p)
            stack.extend(children[p][::-1])
        size: dict[int, int] = {}  # tokens in each subtree
        for p in reversed(order):
            size[p] = 1 + sum(size[c] for c in children[p])
        padding = [p for p in range(width) if p not in size]
        positions = torch.tensor(order + padding, dtype=torch.long)
        numbers = torch.arange(width, dtype=torch.int32)
        enter[r, positions] = numbers
        exit_[r, positions] = numbers + torch.tensor([size[p] for p in order] + [1] * len(padding),
                                                     dtype=torch.int32)
    return FlexTree(enter, exit_)


def tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention interface: ``query [rows, H, W, D]``, ``key/value [rows, KV, W, D]``;
    returns ``[rows, W, H, D]``. With a plan (``kwargs[PLAN]``), attention along the plan's segments (no
    dropout: the learner runs in eval mode); without, SDPA over ``attention_mask`` (:func:`float32_attention`
    on a CPU)."""
    attention_plan: AttentionPlan | None = kwargs.pop(PLAN, None)
    if attention_plan is None:
        return _masked_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)
    rows, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    # on a CPU, 16-bit attention computes in float32 (see float32_attention)
    wide = torch.float32 if query.device.type == "cpu" else query.dtype
    flat_q = query.transpose(1, 2).reshape(rows * width, heads, dim)
    flat_k = key.transpose(1, 2).reshape(rows * width, kv_heads, dim)
    flat_v = value.transpose(1, 2).reshape(rows * width, kv_heads, dim)
    outputs = [query.new_zeros((1, heads, dim))]  # what a padding position gets
    for b in attention_plan.buckets:
        segments, q_max, k_max = b.mask.shape[0], b.mask.shape[2], b.mask.shape[3]
        # index_select, not indexing: its backward is index_add, several times faster on a CPU
        q = flat_q.index_select(0, b.queries).view(segments, q_max, heads, dim).transpose(1, 2).to(wide)
        k = flat_k.index_select(0, b.keys).view(segments, k_max, kv_heads, dim).transpose(1, 2).to(wide)
        v = flat_v.index_select(0, b.keys).view(segments, k_max, kv_heads, dim).transpose(1, 2).to(wide)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b.mask, scale=scaling,
                                                               enable_gqa=kv_heads != heads)
        out = out.transpose(1, 2).reshape(segments * q_max, heads, dim).index_select(0, b.valid)
        outputs.append(out.to(query.dtype))
    return torch.cat(outputs).index_select(0, attention_plan.inverse).view(rows, width, heads, dim), None


def flex_tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention interface, as :func:`tree_attention`, along a :class:`FlexTree`
    (``kwargs[PLAN]``) with FlexAttention: compiled on CUDA; elsewhere uncompiled, or, where gradients are
    needed (FlexAttention has no backward on a CPU), the tree's dense mask through SDPA. 16-bit inputs on
    a CPU compute in float32. Without a tree, SDPA over ``attention_mask``."""
    from torch.nn.attention.flex_attention import flex_attention

    tree: FlexTree | None = kwargs.pop(PLAN, None)
    if tree is None:
        return _masked_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)
    if not isinstance(tree, FlexTree):
        raise TypeError(f"flex attention takes a FlexTree (micro_batches(..., flex=True)), not "
                        f"{type(tree).__name__}")
    wide = torch.float32 if query.device.type == "cpu" else query.dtype
    q, k, v = (x.to(wide) for x in (query, key, value))
    gqa = key.shape[1] != query.shape[1]
    if query.device.type == "cuda":
        out = _compiled_flex_attention()(q, k, v, block_mask=tree.block_mask(), scale=scaling, enable_gqa=gqa)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tree.dense_mask(),
                                                               scale=scaling, enable_gqa=gqa)
    else:
        out = flex_attention(q, k, v, block_mask=tree.block_mask(), scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _masked_attention(module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA over ``attention_mask`` (:func:`float32_attention` on a CPU): a call without a plan."""
    if query.device.type == "cpu":
        return float32_attention(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def supports_tree_attention(config) -> bool:
    """Whether a text model's attention can run along plans: SDPA attention over full causal layers, with
    no sliding window, soft-capping or attention sinks."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if any(getattr(config, key, None) for key in ("sliding_window", "attn_logit_softcapping")):
        return False
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or [])


@functools.cache
def register_tree_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)


@functools.cache
def register_flex_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLEX_ATTENTION, flex_tree_attention)
    AttentionMaskInterface.register(FLEX_ATTENTION, sdpa_mask)
    # uncompiled off CUDA on purpose (exact, for test-sized passes): PyTorch's advice to compile is noise here
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def float32_attention(module, query, key, value, attention_mask, **kwargs):
    """Hugging Face's SDPA attention computed in float32 for 16-bit inputs, the output cast back: on a
    CPU, PyTorch's bfloat16 flash-attention backward runs at half its float32 speed (0.81 s against
    0.44 s for a SmolLM2-135M pass of 1,440 packed tokens), and float32 scores are the more exact."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def wide(x):  # float masks, biases and sinks too: SDPA takes one dtype
        return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                          wide(attention_mask), **{k: wide(v) for k, v in kwargs.items()})
    return out.to(dtype), weights


@functools.cache
def register_float32_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLOAT32_ATTENTION, float32_attention)
    AttentionMaskInterface.register(FLOAT32_ATTENTION, sdpa_mask)
