"""The sampler's own copy of a base model, in a lower precision than the learner's.

Decoding a batch of rows multiplies every row's hidden state by every weight matrix, once per token. In
float32 on a CPU those small-batch products run at a fraction of the machine's matmul peak (38% on
SmolLM2-135M at 32 rows), while CPUs with native bfloat16 arithmetic (AVX-512 BF16, AMX) run the same
products in bfloat16 about twice as fast, and GPUs run them at tensor-core speed. So the engine may
sample from a copy of the base weights in another dtype (``local.sampler_dtype``) while the learner
trains in its own: each LoRA snapshot is folded into the copy (``W + scale * B @ A`` computed in the
learner's dtype, then cast), and the sampled logprobs are the copy's, i.e. those of the policy that
actually sampled. The learner/sampler KL logged by training measures the difference.

On a CPU the copy's linear layers hold their weights pre-packed for oneDNN (:class:`PackedLinear`: no
re-layout of the whole matrix on each call, which a small batch cannot amortise), and single-token decode
attention runs as two batched matrix products (:func:`decode_attention`): PyTorch's fused CPU attention
kernel is several times slower in bfloat16 than in float32 for one query token.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODE_ATTENTION = "polyrl_decode"  # the attention implementation the CPU copy runs (registered on use)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_bf16_feature() -> str | None:
    """The CPU's native bfloat16 arithmetic, named (``AMX-BF16``, ``AVX-512 BF16``), or None.

    PyTorch's public ``torch.backends.cpu.get_cpu_capability()`` names only the vector width it compiled
    for ("AVX512"), which CPUs with and without bfloat16 instructions share; the feature flags come from
    torch's cpuinfo where this build exposes them, else from ``/proc/cpuinfo``."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):  # x86 builds with AVX-512 kernels
        return None
    flags: set[str] = set()
    probe = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if probe is not None:
        try:
            flags = {name for name, on in probe().items() if on is True}
        except Exception:  # noqa: BLE001 - a private probe; /proc/cpuinfo below is the fallback
            flags = set()
    if not flags and sys.platform == "linux":
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                             set())
        except OSError:
            flags = set()
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    return None


def select_sampler_dtype(name: str, device: torch.device, learner: torch.dtype) -> tuple[torch.dtype, str]:
    """The sampler's dtype for ``local.sampler_dtype`` ``name`` and why, in words. ``auto``: bfloat16 on
    CUDA GPUs that support it and on CPUs with native bfloat16 arithmetic, else the learner's dtype."""
    if name != "auto":
        return DTYPES[name], "as configured"
    if learner != torch.float32:
        return learner, "auto: the learner's dtype is already 16-bit"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU has bfloat16"
        return learner, "auto: the GPU has no bfloat16"
    if device.type != "cpu":
        return learner, f"auto: the learner's dtype on {device.type}"
    feature = cpu_bf16_feature()
    if feature is None:
        return learner, "auto: this CPU has no native bfloat16 arithmetic"
    return torch.bfloat16, f"auto: this CPU has {feature}"


# ---- the copy's layers -----------------------------------------------------------------------------
@functools.cache
def _onednn_packing() -> bool:
    """Whether this PyTorch build has oneDNN's pre-packed linear (used by its own CPU compiler)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(torch.nn.Module):
    """A linear layer whose bfloat16 weight is kept in oneDNN's blocked layout (see the module docstring).
    Equal, bit for bit, to ``torch.nn.functional.linear`` with the plain weight."""

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
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one query token per row as two batched matrix products (grouped-query heads share
    their key/value head without copies), softmax in float32; everything else goes to SDPA. Shapes as
    Hugging Face's attention interface: ``query [B, H, 1, D]``, ``key/value [B, KV, L, D]``, the mask
    boolean ``[B, 1, 1, L]`` (True: attend) or None; returns ``[B, 1, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    plain = all(kwargs.get(k) is None for k in ("softcap", "s_aux", "sinks", "position_bias"))
    if q_len != 1 or dropout or not plain or query.device.type != "cpu" or (
            attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float()
    scores.mul_(dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        scores.masked_fill_(~attention_mask.reshape(batch, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KV, group, D]
    return out.reshape(batch, 1, heads, dim), None


@functools.cache
def _register_decode_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


# ---- the copy ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MergeTarget:
    """One weight an adapter changes: where it lives in the copy, the learner's unadapted value, and the
    adapter's delta (computed on demand, in the learner's dtype)."""

    path: str  # the module's name in the bare model
    name: str  # the parameter's name on that module ("weight", or an expert tensor)
    base: torch.Tensor
    delta: Callable[[], torch.Tensor]


Folded = list[tuple[MergeTarget, torch.Tensor]]  # weights to put into the copy, each with its value


class SamplerCopy:
    """A bare Hugging Face model's weights in ``dtype`` on ``device``, with snapshots folded in.

    ``model`` must not be wrapped by PEFT yet; the copy shares nothing with it (buffers such as rotary
    frequencies are copied as they are, not cast). Folded weights are kept per sampling slot while they
    fit in ``max_merged_bytes`` (switching between the bare model and a snapshot then costs nothing), else
    written over the copy's own and recomputed on each switch."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, max_merged_bytes: int):
        self.dtype = dtype
        self.max_merged_bytes = max_merged_bytes
        cast = {id(p): p.detach().to(dtype) if p.is_floating_point() else p.detach().clone()
                for p in model.parameters()}
        memo = {key: torch.nn.Parameter(value, requires_grad=False) for key, value in cast.items()}
        self.model = copy.deepcopy(model, memo)
        self.model.eval()
        device = next(model.parameters()).device
        cpu = device.type == "cpu"
        self.packed = cpu and dtype == torch.bfloat16 and _onednn_packing() and _packs_exactly()
        if self.packed:
            for path, module in list(self.model.named_modules()):
                if type(module) is torch.nn.Linear:
                    self.model.set_submodule(path, PackedLinear(module.weight, module.bias))
        if cpu and dtype != torch.float32 and self.model.config._attn_implementation == "sdpa":
            _register_decode_attention()
            self.model.set_attn_implementation(DECODE_ATTENTION)
        self._cache: dict[str, tuple[object, Folded]] = {}
        self._written: tuple[str, object, list[MergeTarget]] | None = None  # folded over the copy's own

    @property
    def nbytes(self) -> int:
        """Memory the copy holds: its weights (packed or not) and the folded weights it keeps."""
        seen: set[int] = set()
        total = 0
        tensors = [*self.model.parameters()]
        tensors += [m.packed for m in self.model.modules() if isinstance(m, PackedLinear)]
        tensors += [t for _, merged in self._cache.values() for _, t in merged]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the copy's hidden states (its unembedding, then soft-capping in float32)."""
        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _values(self, targets: list[MergeTarget], fold: bool = True) -> Folded:
        """Each target's value for the copy: base + delta (in the learner's dtype, then cast and packed as
        the copy holds it), or the base alone (``fold=False``)."""
        out = []
        with torch.no_grad():
            for t in targets:
                value = (t.base + t.delta().to(t.base.dtype) if fold else t.base).to(self.dtype)
                module = self.model.get_submodule(t.path)
                if isinstance(module, PackedLinear) and t.name == "weight":
                    out.append((t, pack(value)))
                else:
                    out.append((t, torch.nn.Parameter(value, requires_grad=False)))
        return out

    def _swap(self, values: Folded) -> Folded:
        """Put ``values`` into the copy; return what they replaced."""
        replaced = []
        for target, value in values:
            module = self.model.get_submodule(target.path)
            if isinstance(module, PackedLinear) and target.name == "weight":
                replaced.append((target, module.packed))
                module.packed = value
            else:
                replaced.append((target, module._parameters[target.name]))
                module._parameters[target.name] = value
        return replaced

    def _size(self, targets: list[MergeTarget]) -> int:
        return sum(t.base.numel() for t in targets) * torch.finfo(self.dtype).bits // 8

    @contextlib.contextmanager
    def use(self, slot: str | None = None, owner: object = None,
            targets: Callable[[], list[MergeTarget]] = list) -> Iterator[torch.nn.Module]:
        """The copy with sampling slot ``slot``'s snapshot (``owner``'s weights, which change ``targets()``)
        folded in, or the bare copy for ``slot=None``."""
        if self._written is not None and self._written[:2] != (slot, owner):
            self._swap(self._values(self._written[2], fold=False))  # the copy's own weights again
            self._written = None
        if slot is None or self._written is not None:  # the bare copy, or this snapshot written over it
            yield self.model
            return
        cached = self._cache.get(slot)
        if cached is None or cached[0] is not owner:
            self._cache.pop(slot, None)
            wanted = targets()
            if self._size(wanted) > self.max_merged_bytes:  # no room beside the copy: over its own weights
                self._swap(self._values(wanted))
                self._written = (slot, owner, wanted)
                yield self.model
                return
            cached = self._cache[slot] = (owner, self._values(wanted))
        replaced = self._swap(cached[1])
        try:
            yield self.model
        finally:
            self._swap(replaced)


@functools.cache
def _packs_exactly() -> bool:
    """oneDNN's packed product equals the plain one on this machine (checked once on a small matrix)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, pack(weight), None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.equal(got, torch.nn.functional.linear(x, weight)))


def describe(dtype: torch.dtype, reason: str, learner: torch.dtype, nbytes: int) -> str:
    """One line: what the sampler runs in, why, and what its copy costs."""
    if dtype == learner:
        return f"sampler {dtype_name(dtype)} ({reason}), sampling from the learner's weights"
    return (f"sampler {dtype_name(dtype)} ({reason}), learner {dtype_name(learner)}: a "
            f"{nbytes / 2**20:.0f} MiB copy of the weights for sampling")

