"""How the sampler's packed copy of a model decodes on a CPU (see :mod:`polyrl.local.sampler_copy`): in
bfloat16, or in float32 where the CPU has no bfloat16 arithmetic.

A decode step of a small batch is a few hundred small matrix products, and on a CPU their per-call costs
weigh as much as their arithmetic. So the copy's linear layers hold their weights pre-packed for oneDNN
(:class:`PackedLinear`: no re-layout of the whole matrix on each call, which 32 rows cannot amortise); the
query/key/value projections of an attention block and the gate/up projections of an MLP are one product
each (:class:`FusedLinear`); attention of one query token runs as two batched products over the whole
KV-cache buffer, which grows a few positions at a time (:func:`decode_attention`; PyTorch's fused CPU
attention kernel is several times slower in bfloat16 than in float32 for one query token, and the batched
product copies any view of part of a buffer); and a Llama-family decoder decodes without Hugging Face's
per-module dispatch (:class:`FastDecode`), checked at build time against the model's own forward.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch


def with_cache(model: torch.nn.Module, cache) -> dict:
    """The keyword that hands a Hugging Face model its KV cache: ``cache`` where its ``forward`` takes it
    (current transformers, where ``past_key_values`` is deprecated and warns), else ``past_key_values``.
    A PEFT wrapper passes its keywords on to the model it wraps, whose ``forward`` decides."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_keyword(type(inner)): cache}


@functools.cache
def _cache_keyword(cls: type) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"

DECODE_ATTENTION = "polyrl_decode"  # the attention implementation the CPU copy runs (registered on use)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # sibling projections of one input


# ---- layers -------------------------------------------------------------------------------------------
@functools.cache
def onednn_packing() -> bool:
    """Whether this PyTorch build has oneDNN's pre-packed linear (used by its own CPU compiler)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` pre-packed; equal, bit for bit, to ``F.linear`` with the plain weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """A linear layer whose weight (bfloat16 or float32) is kept in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack(weight)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The plain weight (unpacked on each access: for code that inspects it, not for compute)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


class FusedLinear:
    """Sibling projections of one input (query/key/value, gate/up) as one packed product. Its members
    (:class:`FusedMember`) are called one after the other on the same input tensor: the first call
    computes every member's output, the others take their slice of it."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        self.sizes = [int(w.shape[0]) for w in weights]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(weights) + 1)]
        self.packed = pack(torch.cat(weights))
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:  # the same tensor object holds the same values (nothing writes in place)
            self._output = packed_linear(x, self.packed, self.bias)
            self._input = x
        return self._output

    def set_packed(self, packed: torch.Tensor) -> None:
        self.packed, self._input, self._output = packed, None, None


class FusedMember(torch.nn.Module):
    """Member ``index`` of a :class:`FusedLinear`, in the place of the linear layer it replaced."""

    def __init__(self, group: FusedLinear, index: int):
        super().__init__()
        self.group, self.index = group, index
        self.out_features = group.sizes[index]

    @property
    def weight(self) -> torch.Tensor:
        g = self.group
        return g.packed.to_dense()[g.offsets[self.index]:g.offsets[self.index + 1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        return g(x)[..., g.offsets[self.index]:g.offsets[self.index + 1]]


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one query token per row as two batched matrix products (grouped-query heads share
    their key/value head without copies); everything else goes to SDPA. Shapes as Hugging Face's
    attention interface: ``query [B, H, 1, D]``, ``key/value [B, KV, L, D]``, the mask boolean
    ``[B, 1, 1, L]`` (True: attend) or None; returns ``[B, 1, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    plain = all(kwargs.get(k) is None for k in ("softcap", "s_aux", "sinks", "position_bias"))
    if q_len != 1 or dropout or not plain or query.device.type != "cpu" or (
            attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    bias = None
    if attention_mask is not None:  # every layer of a forward pass gets the same mask: one bias for all
        last = getattr(_last_bias, "pair", None)
        if last is None or last[0] is not attention_mask:
            last = _last_bias.pair = (attention_mask, mask_bias(attention_mask.reshape(batch, key.shape[2]),
                                                                key.shape[1], key.dtype))
        bias = last[1]
    out = one_token_attention(query.reshape(batch, heads, dim), key, value,
                              dim**-0.5 if scaling is None else scaling, bias)
    return out.reshape(batch, 1, heads, dim), None


# (mask, bias) of the last forward pass through decode_attention, per thread: engines decode on threads
# of their own, and one thread's pass must not read the bias of another's mask
_last_bias = threading.local()


def one_token_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """``query [B, H, D]`` against ``key/value [B, KV, L, D]`` (contiguous: a view into a larger buffer
    makes the bfloat16 batched product copy it), ``bias [B * KV, 1, L]`` (0 or -inf, the keys' dtype, see
    :func:`mask_bias`) added to the scores; returns ``[B, KV, H / KV, D]``. The scores stay in the keys'
    dtype: scaling, bias and product are one ``baddbmm``, and a bfloat16 softmax computes in float32 and
    rounds once, as a float32 softmax cast back would."""
    batch, heads, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    q = query.reshape(batch * kv_heads, heads // kv_heads, dim)  # [B * KV, group, D]
    keys_t = key.reshape(batch * kv_heads, length, dim).transpose(1, 2)  # [B * KV, D, L]
    if bias is None:
        scores = torch.bmm(q * scaling, keys_t)  # [B * KV, group, L]
    else:
        scores = torch.baddbmm(bias, q, keys_t, alpha=scaling)
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, value.reshape(batch * kv_heads, length, dim))  # [B * KV, group, D]
    return out.reshape(batch, kv_heads, heads // kv_heads, dim)


def mask_bias(mask: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``[B, L]`` mask (True: attend) as the additive bias ``[B * KV, 1, L]`` (0 or -inf, in
    ``dtype``) of :func:`one_token_attention`."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.unsqueeze(1).expand(-1, kv_heads, -1).reshape(-1, 1, mask.shape[1])  # [B * KV, 1, L]


@functools.cache
def register_decode_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)




@functools.cache
def packs_right(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed product equals the plain one on this machine (checked once on a small
    matrix): bit for bit in bfloat16; in float32, where its blocking sums in another order, to float32
    rounding."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    try:
        got = packed_linear(x, pack(weight), None)
    except RuntimeError:
        return False
    want = torch.nn.functional.linear(x, weight)
    if dtype == torch.float32:
        return torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    return bool(torch.equal(got, want))


# ---- one-token decode steps without per-module dispatch ---------------------------------------------
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


class FastDecode:
    """One-token decode steps of a Llama-family decoder (pre-norm blocks of rotary grouped-query attention
    and a gated MLP: Llama, Qwen2/3, Mistral without a sliding window, SmolLM, ...) in the copy's fused
    and packed layers, calling its own norms, rotary embedding and activation. :meth:`build` returns None
    for any other layout; the caller also checks the steps against the model's forward before use."""

    def __init__(self, model: torch.nn.Module):
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads

    @classmethod
    def build(cls, model: torch.nn.Module) -> FastDecode | None:
        config = model.config
        if any(getattr(config, key, None) for key in ("sliding_window", "attn_logit_softcapping",
                                                      "final_logit_softcapping")):
            return None
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
            return None
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        if decoder is None or not isinstance(model.get_output_embeddings(), PackedLinear) or not all(
                hasattr(decoder, part) for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return None
        for layer in decoder.layers:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attention is None or mlp is None or not (
                    {n for n, _ in layer.named_children()} <= _LAYER_PARTS
                    and {n for n, _ in attention.named_children()} <= _ATTENTION_PARTS
                    and {n for n, _ in mlp.named_children()} <= _MLP_PARTS
                    and _fused(attention, ("q_proj", "k_proj", "v_proj"))
                    and _fused(mlp, ("gate_proj", "up_proj"))
                    and isinstance(attention.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)
                    and isinstance(getattr(attention, "scaling", None), float)):
                return None
        return cls(model)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 cache) -> torch.Tensor:
        """Logits (the copy's dtype) ``[B, vocab]`` of one new token per row: ``tokens`` and
        ``positions`` ``[B]``, ``mask`` ``[B, W]`` (1: attend) over the ``W`` positions so far, ``cache`` a
        Hugging Face cache of padded buffer layers (their ``update`` returns the whole buffer)."""
        batch, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.dim
        x = self.decoder.embed_tokens(tokens)  # [B, hidden]
        cos, sin = self.decoder.rotary_emb(x, positions.unsqueeze(1))
        cos, sin = cos.reshape(batch, 1, dim), sin.reshape(batch, 1, dim)  # [B, 1, D]
        half = dim // 2
        bias = None
        for index, layer in enumerate(self.decoder.layers):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = attention.q_proj.group(layer.input_layernorm(x))  # [B, (H + 2 * KV) * D]
            q, k, v = qkv.split(attention.q_proj.group.sizes, dim=-1)
            if hasattr(attention, "q_norm"):  # qk: [B, H + KV, D], the queries then the keys
                qk = torch.cat([attention.q_norm(q.reshape(batch, heads, dim)),
                                attention.k_norm(k.reshape(batch, kv_heads, dim))], dim=1)
            else:
                qk = qkv[:, : (heads + kv_heads) * dim].reshape(batch, heads + kv_heads, dim)
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            keys, values = cache.layers[index].update(qk[:, heads:].unsqueeze(2),  # [B, KV, L, D]
                                                      v.reshape(batch, kv_heads, 1, dim))
            if bias is None:  # one bias for every layer: [B * KV, 1, L]
                attend = torch.zeros((batch, keys.shape[2]), dtype=torch.bool, device=mask.device)  # [B, L]
                attend[:, : mask.shape[1]] = mask.bool()
                bias = mask_bias(attend, kv_heads, keys.dtype)
            # [B, KV, group, D]: the query heads grouped by the key/value head they share
            out = one_token_attention(qk[:, :heads], keys, values, attention.scaling, bias)
            x = x + attention.o_proj(out.reshape(batch, heads * dim))  # [B, hidden]
            gate_up = mlp.gate_proj.group(layer.post_attention_layernorm(x))  # [B, 2 * I]
            gate, up = gate_up.split(mlp.gate_proj.group.sizes, dim=-1)
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        return self.head(self.decoder.norm(x))  # [B, V]


def _fused(parent: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Whether ``parent``'s ``names`` are the members of one :class:`FusedLinear`, in order."""
    members = [getattr(parent, name, None) for name in names]
    return (all(isinstance(m, FusedMember) for m in members) and len({id(m.group) for m in members}) == 1
            and [m.index for m in members] == list(range(len(names))))


def check(fast: FastDecode, model: torch.nn.Module, new_cache: Callable[[], object]) -> bool:
    """Whether ``fast``'s steps give ``model``'s own logits (to bfloat16 rounding) on a short probe:
    two rows, a prefill of 5 and 3 tokens (one left-padded), then two one-token steps."""
    vocab = model.get_output_embeddings().out_features
    ids = torch.tensor([[3, 1, 4, 1, 5], [0, 0, 9, 2, 6]]) % vocab
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [new_cache(), new_cache()]
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **with_cache(model, cache))
        tokens, pos = torch.tensor([7, 8]) % vocab, positions[:, -1] + 1
        for _ in range(2):
            mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], dim=1)
            want = model(input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=pos.unsqueeze(1),
                         use_cache=True, **with_cache(model, caches[0])).logits[:, -1].float()
            got = fast(tokens, pos, mask, caches[1]).float()
            if not torch.allclose(got, want, rtol=0, atol=1e-2 * max(1.0, float(want.abs().max()))):
                return False
            tokens, pos = (tokens + 1) % vocab, pos + 1
    return True
