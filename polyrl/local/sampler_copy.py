"""The sampler's own copy of a base model, in a lower precision than the learner's or laid out for decoding.

Decoding a batch of rows multiplies every row's hidden state by every weight matrix, once per token. In
float32 on a CPU those small-batch products run at a fraction of the machine's matmul peak (38% on
SmolLM2-135M at 32 rows), while CPUs with native bfloat16 arithmetic (AVX-512 BF16, AMX) run the same
products in bfloat16 about twice as fast, and GPUs run them at tensor-core speed. So the engine may
sample from a copy of the base weights in another dtype (``local.sampler_dtype``) while the learner
trains in its own: each LoRA snapshot is folded into the copy (``W + scale * B @ A`` computed in the
learner's dtype, then cast), and the sampled logprobs are the copy's, i.e. those of the policy that
actually sampled. The learner/sampler KL logged by training measures the difference.

On a CPU the copy is built for small decode batches (:mod:`polyrl.local.cpu_decode`): packed and fused
linear layers, attention of one query token as batched products, and Llama-family decoders stepping
without Hugging Face's per-module dispatch. That layout pays in float32 too: on a CPU without bfloat16
arithmetic (AVX2), SmolLM2-135M's weight products at 32 rows ran at 81 GFLOP/s packed against 45 plain,
so there ``auto`` keeps a packed float32 copy beside the float32 learner.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from polyrl.local.cpu_decode import (
    DECODE_ATTENTION,
    FUSED,
    FastDecode,
    FusedLinear,
    FusedMember,
    PackedLinear,
    check,
    onednn_packing,
    pack,
    packs_right,
    register_decode_attention,
)
from polyrl.local.sampler import new_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_ENV = "POLYRL_SAMPLER_DTYPE"  # what ``auto`` stands for on this machine, where set


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


def fast_bfloat16(device: torch.device) -> tuple[bool, str] | None:
    """Whether ``device`` runs bfloat16 products fast (a CUDA GPU that supports bfloat16, a CPU with native
    bfloat16 arithmetic), and why, in words; None for other kinds of device, where ``auto`` does not guess."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return True, "the GPU has bfloat16"
        return False, "the GPU has no bfloat16"
    if device.type != "cpu":
        return None
    feature = cpu_bf16_feature()
    if feature is None:
        return False, "this CPU has no native bfloat16 arithmetic"
    return True, f"this CPU has {feature}"


def env_dtype(variable: str) -> tuple[torch.dtype, str] | None:
    """The dtype environment variable ``variable`` names for ``auto``, and why, or None where it is unset."""
    chosen = os.environ.get(variable, "").strip()
    if not chosen:
        return None
    if chosen not in DTYPES:
        raise ValueError(f"${variable} must be one of {sorted(DTYPES)}, got {chosen!r}")
    return DTYPES[chosen], f"auto: ${variable}"


def select_sampler_dtype(name: str, device: torch.device, learner: torch.dtype) -> tuple[torch.dtype, str]:
    """The sampler's dtype for ``local.sampler_dtype`` ``name`` and why, in words. ``auto``: bfloat16 on
    CUDA GPUs that support it and on CPUs with native bfloat16 arithmetic, else the learner's dtype;
    ``$POLYRL_SAMPLER_DTYPE`` (a dtype name), where set, overrides that guess."""
    if name != "auto":
        return DTYPES[name], "as configured"
    if (override := env_dtype(AUTO_ENV)) is not None:
        return override
    if learner != torch.float32:
        return learner, "auto: the learner's dtype is already 16-bit"
    if (fast := fast_bfloat16(device)) is None:
        return learner, f"auto: the learner's dtype on {device.type}"
    return (torch.bfloat16 if fast[0] else learner), f"auto: {fast[1]}"


# ---- the copy ------------------------------------------------------------------------------------
def packs(dtype: torch.dtype) -> bool:
    """Whether a CPU copy in ``dtype`` decodes from oneDNN-packed weights: bfloat16 where this PyTorch
    build packs it exactly, float32 wherever oneDNN packs (its float32 products round differently from
    the plain ones, within float32 rounding)."""
    return dtype in (torch.bfloat16, torch.float32) and onednn_packing() and packs_right(dtype)


#: ``auto`` keeps its own copy of the weights only where the copy takes at most this share of the free
#: memory on the device (it is a choice of speed or precision, not worth running the machine out of memory)
AUTO_COPY_MAX_SHARE = 0.5


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (a CUDA GPU's free memory, the host's ``MemAvailable`` on
    Linux), or None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu" or sys.platform != "linux":
        return None
    try:
        with open("/proc/meminfo") as f:
            line = next((line for line in f if line.startswith("MemAvailable:")), None)
        return None if line is None else int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        return None


def no_room(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a copy of ``model``'s weights in ``dtype`` should not be made on ``device``, in words: it would
    take more than ``AUTO_COPY_MAX_SHARE`` of the free memory. None where it fits, or where free memory is
    unknown."""
    need = sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()
    free = free_memory(device)
    if free is None or need <= AUTO_COPY_MAX_SHARE * free:
        return None
    return (f"no room for a {need / 2**20:.0f} MiB {dtype_name(dtype)} copy of the weights "
            f"({free / 2**20:.0f} MiB free)")


def wants_copy(device: torch.device, sampler: torch.dtype, learner: torch.dtype, setting: str) -> bool:
    """Whether the sampler needs its own copy of the weights: it samples in another dtype than the
    learner's, or on a CPU in a dtype whose packed, fused decode (:mod:`polyrl.local.cpu_decode`) the
    learner's own modules cannot run. A float32 copy beside a float32 learner is made only where ``auto``
    (``setting``, not overridden by ``$POLYRL_SAMPLER_DTYPE``) guessed float32 (a CPU without bfloat16
    arithmetic: packed float32 decodes ~1.8x faster than the plain products); a configured float32
    sampler samples from the learner's own weights, exactly."""
    if sampler != learner:
        return True
    guessed = setting == "auto" and env_dtype(AUTO_ENV) is None
    return device.type == "cpu" and packs(sampler) and (sampler != torch.float32 or guessed)


@dataclass(frozen=True)
class MergeTarget:
    """One weight an adapter changes: the parameter ``name`` of the module at ``path`` (named as in the
    bare model) and ``add_delta(weight)``, which adds the adapter's delta to a tensor holding that weight
    (in the learner's dtype), in place."""

    path: str
    name: str
    add_delta: Callable[[torch.Tensor], None]


Values = dict[tuple, torch.Tensor]  # a weight holder of the copy (see SamplerCopy._holder) -> its value


def float_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits of ``model``'s hidden states: its unembedding (with an adapter, if it has one),
    then the config's final-logit soft-capping, in float32."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


class SamplerCopy:
    """A bare Hugging Face model's weights in ``dtype``, on its device, with snapshots folded in.

    ``model`` must not be wrapped by PEFT yet. The copy shares no tensor with it (buffers such as rotary
    frequencies are copied as they are, not cast), but remembers its modules: PEFT keeps them as the base
    layers of its wrappers, so folding always starts from the learner's own, unadapted weights. Folded
    weights are kept per sampling slot while they fit in ``max_merged_bytes`` (switching between the
    bare model and a snapshot then costs nothing), else written over the copy's own and recomputed on
    each switch."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, max_merged_bytes: int):
        self.dtype = dtype
        self.max_merged_bytes = max_merged_bytes
        self._source = dict(model.named_modules())
        cast = {id(p): p.detach().to(dtype, copy=True) if p.is_floating_point() else p.detach().clone()
                for p in model.parameters()}
        memo = {key: torch.nn.Parameter(value, requires_grad=False) for key, value in cast.items()}
        self.model = copy.deepcopy(model, memo)
        self.model.eval()
        cpu = next(model.parameters()).device.type == "cpu"
        self.packed = cpu and packs(dtype)
        if self.packed:
            self._pack_linears()
        sdpa = self.model.config._attn_implementation == "sdpa"
        if cpu and (self.packed or dtype != torch.float32) and sdpa:
            register_decode_attention()
            self.model.set_attn_implementation(DECODE_ATTENTION)
        self._cache: dict[str, tuple[object, Values]] = {}
        self._written: tuple[str, object, list[MergeTarget]] | None = None  # folded over the copy's own
        self.fast_step: FastDecode | None = None  # a one-token step without per-module dispatch
        if self.packed and self.model.config._attn_implementation == DECODE_ATTENTION:
            fast = FastDecode.build(self.model)
            if fast is not None and check(fast, self.model, lambda: new_cache(16, padded=True)):
                self.fast_step = fast

    def _pack_linears(self) -> None:
        """Every linear layer packed; sibling projections of one input fused (same input size, all
        with a bias or none)."""
        modules = dict(self.model.named_modules())
        done: set[str] = set()
        for path, module in modules.items():
            for names in FUSED:
                members = [modules.get(f"{path}.{n}" if path else n) for n in names]
                if (all(type(m) is torch.nn.Linear for m in members)
                        and len({m.in_features for m in members}) == 1
                        and len({m.bias is None for m in members}) == 1):
                    group = FusedLinear([m.weight for m in members], [m.bias for m in members])
                    for i, name in enumerate(names):
                        self.model.set_submodule(f"{path}.{name}" if path else name, FusedMember(group, i))
                        done.add(f"{path}.{name}" if path else name)
        for path, module in modules.items():
            if type(module) is torch.nn.Linear and path not in done:
                self.model.set_submodule(path, PackedLinear(module.weight, module.bias))

    @property
    def nbytes(self) -> int:
        """Memory the copy holds: its weights (packed or not) and the folded weights it keeps."""
        tensors = {id(t): t for t in self.model.parameters()}
        for holder in self._holders():
            tensors.setdefault(id(self._get(holder)), self._get(holder))
        for _, values in self._cache.values():
            tensors.update({id(t): t for t in values.values()})
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the copy's hidden states (its unembedding, then soft-capping in float32)."""
        return float_logits(self.model, hidden)

    # ---- weight holders: a packed linear, a fused group, or a parameter ------------------------------
    def _holders(self) -> Iterator[tuple]:
        groups: dict[int, FusedLinear] = {}
        for path, module in self.model.named_modules():
            if isinstance(module, PackedLinear):
                yield ("packed", path)
            elif isinstance(module, FusedMember):
                groups.setdefault(id(module.group), module.group)
        for group in groups.values():
            yield ("fused", group)

    def _holder(self, target: MergeTarget) -> tuple:
        module = self.model.get_submodule(target.path)
        if isinstance(module, FusedMember) and target.name == "weight":
            return ("fused", module.group)
        if isinstance(module, PackedLinear) and target.name == "weight":
            return ("packed", target.path)
        return ("param", target.path, target.name)

    def _get(self, holder: tuple) -> torch.Tensor:
        if holder[0] == "fused":
            return holder[1].packed
        module = self.model.get_submodule(holder[1])
        return module.packed if holder[0] == "packed" else module._parameters[holder[2]]

    def _set(self, holder: tuple, value: torch.Tensor) -> None:
        if holder[0] == "fused":
            holder[1].set_packed(value)
        elif holder[0] == "packed":
            self.model.get_submodule(holder[1]).packed = value
        else:
            self.model.get_submodule(holder[1])._parameters[holder[2]] = value

    def _learner(self, path: str, name: str) -> torch.Tensor:
        return getattr(self._source[path], name)

    def _values(self, targets: list[MergeTarget], fold: bool = True) -> Values:
        """The value of every holder ``targets`` touch: the learner's weights plus each target's delta
        (``fold=False``: without), computed in the learner's dtype, then cast and packed as held."""
        adds = {(t.path, t.name): t.add_delta for t in targets} if fold else {}
        scratch: dict[torch.dtype, torch.Tensor] = {}
        values: Values = {}
        with torch.no_grad():
            for t in targets:
                holder = self._holder(t)
                if holder in values:
                    continue
                keys = [(t.path, t.name)]
                if holder[0] == "fused":
                    parent, _, leaf = t.path.rpartition(".")
                    names = next(n for n in FUSED if leaf in n)
                    keys = [(f"{parent}.{n}" if parent else n, "weight") for n in names]
                folded = self._folded(keys, adds, scratch)  # a view of scratch memory
                if holder[0] == "param":
                    values[holder] = torch.nn.Parameter(folded.clone(), requires_grad=False)
                else:
                    packed = pack(folded)  # oneDNN's own tensor, or a plain one where no reorder was needed
                    shares = not packed.is_mkldnn and packed.data_ptr() == folded.data_ptr()
                    values[holder] = packed.clone() if shares else packed
        return values

    def _folded(self, keys: list[tuple[str, str]], adds: dict, scratch: dict) -> torch.Tensor:
        """The learner's weights ``keys`` (module path, parameter name) stacked along their first
        dimension, each plus its delta where ``adds`` has one (summed in float32, or in the learner's dtype
        if wider), cast to the copy's dtype: a view of ``scratch``'s buffers, which the next call
        overwrites. Buffers reused from weight to weight spare the fold fresh temporaries, which the OS
        zeroes page by page (~2 GB a snapshot of SmolLM2-135M when each delta, sum and cast had its own:
        1.15 s a fold, 0.4 s now)."""
        weights = [self._learner(*key) for key in keys]
        shape = (sum(int(w.shape[0]) for w in weights), *weights[0].shape[1:])
        numel = shape[0] * weights[0][0].numel()

        def buffer(dtype: torch.dtype) -> torch.Tensor:
            if dtype not in scratch or scratch[dtype].numel() < numel:
                scratch[dtype] = torch.empty(numel, dtype=dtype, device=weights[0].device)
            return scratch[dtype][:numel].view(shape)

        out = buffer(torch.promote_types(weights[0].dtype, torch.float32))  # the adapters' float32
        torch.cat(weights, out=out)
        for key, part in zip(keys, out.split([int(w.shape[0]) for w in weights])):
            if key in adds:
                adds[key](part)
        return out if out.dtype == self.dtype else buffer(self.dtype).copy_(out)

    def _swap(self, values: Values) -> Values:
        """Put ``values`` into the copy; return what they replaced."""
        replaced = {holder: self._get(holder) for holder in values}
        for holder, value in values.items():
            self._set(holder, value)
        return replaced

    def _size(self, targets: list[MergeTarget]) -> int:
        bits = torch.finfo(self.dtype).bits
        return sum(self._learner(t.path, t.name).numel() for t in targets) * bits // 8

    def forget(self, slot: str) -> None:
        """Drop what the copy keeps for sampling slot ``slot`` (its folded weights, and the snapshot's
        owner they were made for); a snapshot written over the copy's own weights is undone first."""
        self._cache.pop(slot, None)
        if self._written is not None and self._written[0] == slot:
            self._swap(self._values(self._written[2], fold=False))
            self._written = None

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


def describe(dtype: torch.dtype, reason: str, learner: torch.dtype, learner_reason: str, nbytes: int) -> str:
    """One line: what the sampler and the learner run in, why, and what the sampler's copy costs."""
    head = f"sampler {dtype_name(dtype)} ({reason}), learner {dtype_name(learner)} ({learner_reason})"
    if not nbytes:
        return f"{head}, sampling from the learner's weights"
    size = f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"  # tiny models
    return f"{head}: a {size} copy of the weights for sampling"
