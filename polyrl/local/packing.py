"""Packing a ``forward_backward`` batch into rows that compute every shared prefix once.

A GRPO group's samples share their prompt, and a multi-turn episode's datums share its earlier
turns; computed one datum per row, every shared token is recomputed for every datum. Here datums
are sorted by their input tokens, so datums with common prefixes sit next to each other, and laid
into rows left to right: a datum placed after another reuses the packed tokens of their longest
common prefix and appends only the rest. Each packed token attends to exactly the tokens of its
own datum's prefix (a tree-shaped causal mask) and carries its position in that datum, so every
hidden state is the one the datum computed alone would have (tested to 1e-5).

Under a dense mask, attention over a row costs in proportion to the row's length for every token in
it, so rows are not made longer than they pay for: a datum that shares a prefix joins the row
when computing it there (its new tokens, attending over the longer row) costs less than a row of
its own; unrelated datums share a row, without padding between them, up to the length of the
longest datum (which padding would cost anyway). Under tree or flex attention (:mod:`polyrl.local.attention`,
a plan or the rows' trie instead of the mask) a token attends to its own datum's path whatever the row's
length, so every datum joins the row until it is full. Rows are then grouped, sorted by length, into
micro-batches of at most ``budget`` padded tokens: the fewest micro-batches, then the least padding.

Images (vision-language models): a datum's image positions hold a negative key for (the image, its
place) (:func:`polyrl.local.vision.keyed`), so datums share a prefix only where they show the same images
at the same places, and a shared image is laid (and encoded) once per row. Each packed token carries its
datum's multimodal positions (``mrope``: ``[3, length]`` per datum), a shared prefix's being the same in
every datum that shares it; ``MicroBatch.image_keys`` lists the images in the order their placeholders
appear in the rows, the order the model fills them in. Packing stays exact with images (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from polyrl.config.schema import DEFAULT_MICRO_BATCH_TOKENS
from polyrl.local.attention import AttentionPlan, FlexTree, flex_tree, plan

# Cost of a token in the linear layers, in units of one query-key pair of attention, when a model
# does not say (see BaseModel.attention_cost_ratio).
DEFAULT_LINEAR_PER_PAIR = 1000.0
# What one more micro-batch costs on a CPU, in tokens of compute: measured on SmolLM2-135M (2 threads), a
# forward_backward call costs ~0.1-0.2 s beside ~9 ms a token.
CPU_CALL_TOKENS = 20
# local.micro_batch_tokens 'auto' on a CUDA GPU: DEFAULT_MICRO_BATCH_TOKENS per this much of its memory, at
# most GPU_MAX_MICRO_BATCH_TOKENS
GPU_MEMORY_PER_MICRO_BATCH_UNIT = 20 << 30
GPU_MAX_MICRO_BATCH_TOKENS = 4 * DEFAULT_MICRO_BATCH_TOKENS


def micro_batch_budget(setting: int | str, device: torch.device) -> int:
    """The tokens of one forward/backward pass for ``local.micro_batch_tokens`` ``setting`` on ``device``:
    as set, or for ``"auto"``: ``DEFAULT_MICRO_BATCH_TOKENS`` on a CPU (its cost is its tokens, and its
    working set stays in cache); on a CUDA GPU that many per 20 GiB of its memory, up to four times as
    many. A GPU pass of a small model costs its kernel launches more than its tokens: a 64-datum step of
    SmolLM2-135M on an H200 took 0.68 s in three passes of 4,096 tokens, 0.34 s in one of 16,384."""
    if setting != "auto":
        return int(setting)
    if device.type != "cuda":
        return DEFAULT_MICRO_BATCH_TOKENS
    units = torch.cuda.get_device_properties(device).total_memory // GPU_MEMORY_PER_MICRO_BATCH_UNIT
    return int(min(GPU_MAX_MICRO_BATCH_TOKENS, DEFAULT_MICRO_BATCH_TOKENS * max(1, units)))


@dataclass
class Row:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    paths: dict[int, list[int]] = field(default_factory=dict)  # datum index -> packed index of each token

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class MicroBatch:
    """Rows padded to one width, and where each datum's tokens are in them."""

    datums: list[int]  # datum indices, in the order their tokens are laid out in ``gather``
    input_ids: torch.Tensor  # [rows, width]
    position_ids: torch.Tensor  # [rows, width]
    attend: torch.Tensor  # [rows, 1, width, width] bool: query attends to key ([rows, 1, 1, 1] with a plan)
    gather: torch.Tensor  # [sum of datum lengths] flat index into rows * width, datum after datum
    lengths: list[int]  # token count of each datum in ``datums``
    image_keys: list[int] = field(default_factory=list)  # images, in the order their placeholders appear
    vision: dict = field(default_factory=dict)  # the images' pixel values and grids (set by the engine)
    plan: AttentionPlan | FlexTree | None = None  # attention along each datum's path, instead of ``attend``

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pack_rows(sequences: list[list[int]], max_row: int,
              linear_per_pair: float = DEFAULT_LINEAR_PER_PAIR, tree: bool = False) -> list[Row]:
    """Rows holding every sequence, sharing common prefixes of sequences adjacent in sorted order.

    Cost of a row of length ``L`` with ``T`` packed tokens: ``linear_per_pair * T + L**2``. A sequence
    of ``n`` tokens sharing ``s`` with the previous one joins the current row (length ``L``) when
    ``linear_per_pair * (n - s) + (L + n - s)**2 - L**2 <= linear_per_pair * n + n**2`` and the row
    stays within ``max_row``; an unrelated one joins while the row stays within the longest sequence.
    ``tree`` (attention along each datum's path, so a row costs its tokens whatever its length): every
    sequence joins while the row stays within ``max_row``, so rows are full and padding least."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    longest = max((len(s) for s in sequences), default=0)
    rows: list[Row] = []
    row, prev = Row(), None
    for i in order:
        seq = sequences[i]
        n, shared = len(seq), (_common_prefix(sequences[prev], seq) if prev is not None and row.tokens else 0)
        grown = len(row) + n - shared
        if tree:
            fits = grown <= max(max_row, n)
        elif shared:
            fits = grown <= max(max_row, n) and (
                linear_per_pair * (n - shared) + grown**2 - len(row) ** 2 <= linear_per_pair * n + n**2)
        else:
            fits = grown <= longest
        if row.tokens and not fits:
            rows.append(row)
            row, shared = Row(), 0
        start = len(row)
        row.tokens.extend(seq[shared:])
        row.positions.extend(range(shared, n))
        row.paths[i] = (row.paths[prev][:shared] if shared else []) + list(range(start, len(row)))
        prev = i
    if row.tokens:
        rows.append(row)
    return rows


def group_rows(lengths: list[int], budget: int, call_tokens: int | None = None) -> list[list[int]]:
    """Row indices grouped into micro-batches of at most ``budget`` padded tokens (a row longer than
    that goes alone). ``call_tokens=None``: the fewest micro-batches, and among those the least
    padding (where a call costs far more than a token, as on a GPU); else the least ``padded tokens +
    call_tokens * micro-batches`` (on a CPU a padded token costs as much as a real one, so a short
    row padded to a long one's width can cost more than a call of its own). Rows are sorted by length, so
    each micro-batch is a run of that order; a dynamic program over the runs picks the cuts (a greedy
    fill can pad a short row to a long one where a different cut would not)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [lengths[i] for i in order]
    n = len(sizes)

    def cost(batches: int, padded: int) -> tuple[int, ...]:
        return (batches, padded) if call_tokens is None else (padded + call_tokens * batches, batches)

    # best[j]: (micro-batches, padded tokens) for the first j sorted rows; cut[j]: where the last starts
    best: list[tuple[int, int]] = [(0, 0)] + [(n + 1, sum(sizes) * n + 1)] * n  # worse than any cut
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = sizes[j - 1]
        for i in range(j - 1, -1, -1):
            padded = longest * (j - i)
            if i < j - 1 and padded > budget:
                break
            cand = (best[i][0] + 1, best[i][1] + padded)
            if cost(*cand) < cost(*best[j]):
                best[j], cut[j] = cand, i
    batches, j = [], n
    while j > 0:
        batches.append(order[cut[j]:j])
        j = cut[j]
    return batches[::-1]


def micro_batches(sequences: list[list[int]], budget: int, linear_per_pair: float = DEFAULT_LINEAR_PER_PAIR,
                  device: torch.device | str = "cpu", mrope: list[torch.Tensor | None] | None = None,
                  placeholder: int = 0, call_tokens: int | None = None, tree: bool = False, flex: bool = False
                  ) -> list[MicroBatch]:
    """Packed rows of ``sequences`` in micro-batches of at most ``budget`` padded tokens, grouped as
    :func:`group_rows` does with ``call_tokens``. With ``mrope`` (vision-language models),
    negative tokens are image keys (laid as ``placeholder``) and positions are ``[4, rows, width]``: the
    token's index, then its datum's multimodal positions. ``tree``: each micro-batch carries the plan of
    attention along its datums' paths (:mod:`polyrl.local.attention`) instead of a dense mask; with ``flex``,
    its rows' :class:`FlexTree` (for FlexAttention) instead of the plan."""
    rows = pack_rows(sequences, budget, linear_per_pair, tree)
    return [_tensors([rows[i] for i in idx], device, mrope, placeholder, tree, flex)
            for idx in group_rows([len(r) for r in rows], budget, call_tokens)]


def _tensors(rows: list[Row], device, mrope: list[torch.Tensor | None] | None = None,
             placeholder: int = 0, tree: bool = False, flex: bool = False) -> MicroBatch:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    multimodal = pos.unsqueeze(0).repeat(3, 1, 1) if mrope is not None else None
    image_keys: list[int] = []
    attend = torch.zeros((len(rows), 1, 1 if tree else width, 1 if tree else width), dtype=torch.bool)
    # padding attends to itself only, so no attention row is empty (an empty one is NaN in softmax)
    attend[:, 0].diagonal(dim1=-2, dim2=-1).fill_(True)
    datums, gather, lengths = [], [], []
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row.tokens)
        pos[r, : len(row)] = torch.tensor(row.positions)
        if multimodal is not None:
            multimodal[:, r, : len(row)] = pos[r, : len(row)]
            tokens = row.tokens
            image_keys += [t for k, t in enumerate(tokens) if t < 0 and (k == 0 or tokens[k - 1] != t)]
        for d, path in row.paths.items():
            p = torch.tensor(path)
            if multimodal is not None and mrope[d] is not None:
                multimodal[:, r, p] = mrope[d]
            if not tree:  # token k of the datum attends to tokens 0..k of the same datum
                causal = torch.ones((len(p), len(p)), dtype=torch.bool).tril_()
                block = attend[r, 0][p.unsqueeze(1), p.unsqueeze(0)]
                attend[r, 0][p.unsqueeze(1), p.unsqueeze(0)] = block | causal
            datums.append(d)
            gather.append(p + r * width)
            lengths.append(len(p))
    if multimodal is not None:
        ids = ids.masked_fill(ids < 0, placeholder)
        pos = torch.cat([pos.unsqueeze(0), multimodal])
    along: AttentionPlan | FlexTree | None = None
    if tree:
        paths = [row.paths for row in rows]
        along = (flex_tree(paths, width) if flex else plan(paths, width)).to(device)
    return MicroBatch(datums, ids.to(device), pos.to(device), attend.to(device), torch.cat(gather).to(device),
                      lengths, image_keys, plan=along)
