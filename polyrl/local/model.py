"""A base model in memory with any number of named LoRA adapters (PEFT).

One :class:`BaseModel` per base model per engine: training clients each own an adapter (their own
parameters and optimizer); sampling clients hold *snapshots* of adapter weights, which are copied
into a shared sampling slot before a batch is generated. All methods run on the engine's worker
thread, so switching the active adapter never races.

Vision-language models (a config with a ``vision_config``) load with ``AutoModelForImageTextToText``;
``BaseModel.vision`` then turns image chunks into what the model takes (:mod:`polyrl.local.vision`).
LoRA adapts the language model (its attention, MLP and unembedding) and never the vision tower or its
projector, which keep their pretrained weights, as Tinker's LoRA does.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from polyrl.errors import UserInputError
from polyrl.local.attention import (
    FLEX_ATTENTION,
    FLOAT32_ATTENTION,
    PLAN,
    TREE_ATTENTION,
    AttentionPlan,
    FlexTree,
    register_flex_attention,
    register_float32_attention,
    register_tree_attention,
    supports_tree_attention,
)
from polyrl.local.packing import DEFAULT_LINEAR_PER_PAIR
from polyrl.local.sampler_copy import (
    DTYPES,
    MergeTarget,
    SamplerCopy,
    describe,
    env_dtype,
    fast_bfloat16,
    float_logits,
    no_room,
    select_sampler_dtype,
    wants_copy,
)
from polyrl.local.vision import Vision, is_vision_config
from polyrl.models import check_hub_model, resolve_model_path

LORA_ALPHA = 32
# ``gradient_checkpointing: auto`` turns it on from this many base-model parameters: below it,
# activations are small next to the weights and recomputing them would only cost time.
CHECKPOINTING_AUTO_PARAMS = 300_000_000
MASKED_ATTENTION_SLOWDOWN = 2.0
# Sampling from a LoRA snapshot uses the adapter folded into a copy of the weights it adapts (no side
# branch per layer: ~8% fewer FLOPs and ~800 fewer ops per decode step on a 30-layer model) when that
# copy takes at most this much memory; bigger models sample through PEFT's side branches (or, with a
# sampler copy in another dtype, fold the snapshot over the copy's own weights).
MERGED_SAMPLING_MAX_BYTES = 2 << 30
#: Held while a Hugging Face model loads: loading is not thread-safe (a module built on one thread can
#: land on another load's meta device: "Cannot copy out of meta tensor"). A script that loads models
#: with transformers on another thread beside polyrl can hold it too.
MODEL_LOAD_LOCK = threading.Lock()
DTYPE_ENV = "POLYRL_DTYPE"  # what ``local.dtype: auto`` stands for on this machine, where set
# Below this hidden size a CPU learner stays float32 under ``auto``: its products are too small for
# bfloat16's speed to outweigh the casts around them (the tiny quickstart model, hidden size 64, took 188 s
# for its warm start in bfloat16 against 120 s in float32; SmolLM2-135M, 576, trains ~1.6x faster).
CPU_BFLOAT16_MIN_HIDDEN = 512


def select_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA, then Apple MPS, then CPU."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def select_dtype(dtype: str, device: torch.device, hidden_size: int | None = None) -> tuple[torch.dtype, str]:
    """The learner's dtype for ``local.dtype`` ``dtype`` and why, in words. ``auto``: bfloat16 on GPUs that
    support it, and on CPUs with native bfloat16 arithmetic (AVX-512 BF16, AMX: bfloat16 products run
    there at ~2.2x float32's rate) for models of hidden size ``CPU_BFLOAT16_MIN_HIDDEN`` and up (or of
    unknown size), else float32; ``$POLYRL_DTYPE`` (a dtype name), where set, overrides that guess.
    Adapters and their optimizer state are float32 whatever the base's dtype."""
    if dtype != "auto":
        return DTYPES[dtype], "as configured"
    if (override := env_dtype(DTYPE_ENV)) is not None:
        return override
    if (fast := fast_bfloat16(device)) is None:
        return torch.float32, f"auto: float32 on {device.type}"
    if fast[0] and device.type == "cpu" and hidden_size is not None and hidden_size < CPU_BFLOAT16_MIN_HIDDEN:
        return torch.float32, f"auto: hidden size {hidden_size} is too small to gain from bfloat16"
    return (torch.bfloat16 if fast[0] else torch.float32), f"auto: {fast[1]}"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    seed: int | None = None

    @property
    def shape_key(self) -> tuple:
        """Adapters with equal shape keys have identically shaped parameters."""
        return (self.rank, self.train_mlp, self.train_attn, self.train_unembed)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "train_mlp": self.train_mlp,
            "train_attn": self.train_attn,
            "train_unembed": self.train_unembed,
            "seed": self.seed,
        }


class BaseModel:
    """A Hugging Face causal LM wrapped by PEFT, holding named LoRA adapters."""

    def __init__(self, name: str, device: str = "auto", dtype: str = "auto",
                 gradient_checkpointing: bool | str = "auto", sampler_dtype: str = "auto",
                 attention: str = "auto"):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        self.name = name
        self.path = resolve_model_path(name)
        if self.path == name and not os.path.isdir(name):  # a hub id
            check_hub_model(name)
        self.device = select_device(device)
        try:
            with MODEL_LOAD_LOCK:
                self.config = AutoConfig.from_pretrained(self.path)
                text = getattr(self.config, "text_config", None) or self.config
                self.dtype, self.dtype_reason = select_dtype(dtype, self.device,
                                                             getattr(text, "hidden_size", None))
                vision = is_vision_config(self.config)
                loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
                model = loader.from_pretrained(self.path, dtype=self.dtype)
        except OSError as e:  # the hub's or a file's error: its first line (the rest is advice on setup)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserInputError(f"model {name!r} could not be loaded: {first}") from None
        model.to(self.device)
        model.eval()  # no dropout: sampler and learner must compute the same logprobs
        model.requires_grad_(False)
        self.hf_model = model
        self.vision = Vision(model, self.path, self.config) if is_vision_config(self.config) else None
        self.peft_model = None  # created with the first adapter
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._adapter_specs: dict[str, LoraSpec] = {}
        self._sampling_slots: dict[tuple, str] = {}
        self._slot_owner: dict[str, object] = {}
        self._slot_names = itertools.count()  # slots come and go (release_snapshot): names are never reused
        self._merged: dict[str, tuple[object, list[tuple[torch.nn.Module, torch.nn.Parameter]]]] = {}
        self._tokenizer = None
        self._linears = self._linear_layers()
        self._lora_widths = self._layer_widths()
        self.num_parameters = sum(p.numel() for p in model.parameters())
        # the sampler's own copy of the weights when it samples in another dtype or decodes packed on a CPU
        # (before PEFT wraps the model and the blocks are wrapped for checkpointing, neither of which the
        # copy shares)
        self.sampler_dtype, self.sampler_reason = select_sampler_dtype(sampler_dtype, self.device, self.dtype)
        if self.vision is not None and self.sampler_dtype != self.dtype:  # images go through the learner's
            self.sampler_dtype = self.dtype
            self.sampler_reason = "a vision-language model samples in the learner's dtype"
        wanted = (self.vision is None
                  and wants_copy(self.device, self.sampler_dtype, self.dtype, sampler_dtype))
        if wanted and sampler_dtype == "auto" and (why := no_room(model, self.sampler_dtype, self.device)):
            self.sampler_dtype, self.sampler_reason = self.dtype, f"{self.sampler_reason}, but {why}"
            wanted = False  # auto samples from the learner's weights rather than run the machine short
        self.sampler_copy = (SamplerCopy(model, self.sampler_dtype, MERGED_SAMPLING_MAX_BYTES) if wanted
                             else None)
        self.attention = self._select_attention(attention)
        self.tree_attention = self.attention != "dense"  # rows packed full, attending along each datum's path
        if self.attention == "tree":
            register_tree_attention()
            model.set_attn_implementation(TREE_ATTENTION)
        elif self.attention == "flex":
            register_flex_attention()
            model.set_attn_implementation(FLEX_ATTENTION)
        elif (self.device.type == "cpu" and self.dtype != torch.float32 and self.vision is None
                and model.config._attn_implementation == "sdpa"):
            register_float32_attention()
            model.set_attn_implementation(FLOAT32_ATTENTION)
        if gradient_checkpointing == "auto":
            gradient_checkpointing = self.num_parameters >= CHECKPOINTING_AUTO_PARAMS
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self._wrap_layers_for_checkpointing()
        self._split_head: bool | None = None  # whether decoder + unembedding reproduce the model's logits
        self.linear_per_pair = self._linear_per_pair()

    def _select_attention(self, setting: str) -> str:
        """How packed rows attend, for ``local.attention`` ``setting`` (see :mod:`polyrl.local.attention`):
        ``dense``, ``tree`` or ``flex`` as set; ``auto``: tree on a CPU where the model allows it (a GPU
        keeps the dense mask until tree attention is measured there), else dense. Tree and flex attention
        need a text model whose attention :func:`supports_tree_attention`: asked for elsewhere, an error."""
        if setting not in ("auto", "dense", "tree", "flex"):
            raise UserInputError(f"local.attention: 'auto', 'dense', 'tree' or 'flex', not {setting!r}")
        along = self.vision is None and supports_tree_attention(self.hf_model.config)
        if setting == "auto":
            return "tree" if self.device.type == "cpu" and along else "dense"
        if setting != "dense" and not along:
            raise UserInputError(
                f"local.attention {setting!r}: model {self.name!r} cannot attend along packed datums' paths "
                "(that needs a text model with SDPA attention over full causal layers, without a sliding "
                "window, soft-capping or attention sinks); use 'auto' or 'dense'")
        return setting

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._tokenizer

    @property
    def arch(self) -> str:
        return (getattr(self.config, "architectures", None) or [type(self.hf_model).__name__])[0]

    @property
    def text_config(self):
        """The language model's config (a vision-language model's ``text_config``)."""
        return getattr(self.config, "text_config", None) or self.config

    @property
    def max_context_length(self) -> int | None:
        return getattr(self.text_config, "max_position_embeddings", None)

    # ---- training forward: decoder layers (checkpointed) and the unembedding apart ---------
    def _decoder_layers(self) -> torch.nn.ModuleList | None:
        """The stack of transformer blocks: the longest ``ModuleList`` of the decoder."""
        decoder = self.hf_model.get_decoder() if hasattr(self.hf_model, "get_decoder") else self.hf_model
        lists = [m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList)]
        return max(lists, key=len) if lists else None

    def _wrap_layers_for_checkpointing(self) -> None:
        """Make each transformer block recompute its activations in backward when checkpointing is on.

        Hugging Face's own switch only acts in ``train()`` mode, which would also turn dropout on (and
        sampler and learner must compute the same logprobs), so the blocks are wrapped here instead."""
        from torch.utils.checkpoint import checkpoint

        layers = self._decoder_layers()
        for layer in layers if layers is not None else []:
            inner = layer.forward

            def forward(*args, _inner=inner, **kwargs):
                if self.gradient_checkpointing and torch.is_grad_enabled():
                    return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
                return _inner(*args, **kwargs)

            layer.forward = forward

    def _linear_per_pair(self) -> float:
        """A token's cost in the linear layers in units of one query-key pair of attention (for packing:
        see :mod:`polyrl.local.packing`): ``2 * params per block`` over ``4 * heads * head_dim``, halved
        because masked attention runs at about half the speed of the matrix multiplies."""
        layers = self._decoder_layers()
        heads = getattr(self.text_config, "num_attention_heads", None)
        hidden = getattr(self.text_config, "hidden_size", None)
        text = self.text_config
        head_dim = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
        if not layers or not heads or not head_dim:
            return DEFAULT_LINEAR_PER_PAIR
        per_block = sum(p.numel() for p in layers[0].parameters())
        return 2 * per_block / (4 * heads * head_dim) / MASKED_ATTENTION_SLOWDOWN

    def packed_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: torch.Tensor,
                       plan: AttentionPlan | FlexTree | None = None, **vision: torch.Tensor
                       ) -> tuple[torch.Tensor, bool]:
        """Packed rows through the model with the active adapter, under a boolean ``attend`` mask
        ``[rows, 1, width, width]`` (query attends to key), or along ``plan`` (tree attention's plan, or the
        rows' :class:`FlexTree` for flex attention; ``attend`` is then a placeholder): ``(last hidden
        states, True)`` when the unembedding can be applied apart (:meth:`logits`), else ``(float32 logits,
        False)``. ``vision``: the rows' images (``pixel_values``, ``image_grid_thw``) for a vision-language
        model, whose ``position_ids`` are then ``[4, rows, width]``."""
        mask: torch.Tensor = attend
        along = {PLAN: plan} if plan is not None else {}
        if self.hf_model.config._attn_implementation == "eager":  # eager adds the mask to the scores
            mask = torch.zeros(attend.shape, dtype=self.dtype, device=attend.device)
            mask.masked_fill_(~attend, torch.finfo(self.dtype).min)
        if vision:  # the multimodal model: images encoded and placed, then the language model
            out = self.vision.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                    use_cache=False, **vision)
            return out.last_hidden_state, True
        if self.split_head:
            out = self.hf_model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                              attention_mask=mask, use_cache=False, **along)
            return out.last_hidden_state, True
        out = self.hf_model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                            use_cache=False, **along)
        return out.logits.float(), False

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states (the model's unembedding, with its adapter, and soft-capping)."""
        return float_logits(self.hf_model, hidden)

    @property
    def split_head(self) -> bool:
        """Whether ``logits(decoder(x))`` equals the model's own logits (checked once on a short input).

        Architectures that scale or otherwise post-process logits in their own way fail the check, and
        the engine then computes full logits through the whole model instead."""
        if self._split_head is None:
            self._split_head = False
            if hasattr(self.hf_model, "get_decoder") and self.hf_model.get_output_embeddings() is not None:
                ids = torch.arange(1, 9, device=self.device).remainder(self.vocab_size).unsqueeze(0)
                with torch.no_grad():
                    want = self.hf_model(input_ids=ids, use_cache=False).logits.float()
                    hidden = self.hf_model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
                    got = self.logits(hidden)
                scale = float(want.abs().max()) or 1.0
                self._split_head = bool((got - want).abs().max() <= 1e-4 * scale)
        return self._split_head

    # ---- adapters -------------------------------------------------------------------------
    def _linear_layers(self) -> dict[str, tuple[str, str]]:
        """What LoRA can train in the bare model, found once before PEFT wraps it (afterwards the LoRA
        sub-layers would look like targets too): name -> (kind, how). Kind is attn | mlp | unembed; how is
        ``module`` for linear layers, ``parameter`` for the fused expert weights of mixture-of-experts
        blocks (3-D parameters, one matrix per expert, which PEFT reaches through ``target_parameters``)."""
        out_emb = self.hf_model.get_output_embeddings()
        kinds = {}
        for name, module in self.hf_model.named_modules():
            lowered = name.lower()
            if self.vision is not None and {"visual", "vision_tower"} & set(lowered.split(".")):
                continue  # the vision tower and its projector keep their weights
            if isinstance(module, torch.nn.Linear):
                if module is out_emb:
                    kinds[name] = ("unembed", "module")
                elif "attn" in lowered or "attention" in lowered:
                    kinds[name] = ("attn", "module")
                elif any(key in lowered for key in ("mlp", "feed_forward", "ffn", "expert")):
                    kinds[name] = ("mlp", "module")
            elif "expert" in lowered:
                for param_name, param in module.named_parameters(recurse=False):
                    if param.ndim == 3:
                        kinds[f"{name}.{param_name}"] = ("mlp", "parameter")
        return kinds

    def _layer_widths(self) -> dict[str, int]:
        """For each layer LoRA can train, its input plus output width (times its experts for fused expert
        weights): an adapter of rank r adds r times that many parameters there."""
        widths = {}
        for name, (_, how) in self._linears.items():
            if how == "module":
                layer = self.hf_model.get_submodule(name)
                widths[name] = layer.in_features + layer.out_features
            else:
                experts, rows, cols = self.hf_model.get_parameter(name).shape
                widths[name] = experts * (rows + cols)
        return widths

    def lora_parameters(self, spec: LoraSpec) -> int:
        """How many parameters an adapter of ``spec`` has, from the layers' shapes, without making it (what
        admitting a new adapter will cost)."""
        wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
        return spec.rank * sum(self._lora_widths[n] for n, (kind, _) in self._linears.items() if wanted[kind])

    @property
    def width(self) -> int:
        """The model's hidden size: a LoRA of a higher rank adds nothing a full-rank update would not."""
        return int(self.text_config.hidden_size)

    def lora_targets(self, spec: LoraSpec) -> dict[str, list[str]]:
        """``target_modules`` and ``target_parameters`` (full names) of the layers ``spec`` trains. A kind
        asked for that matches nothing is an error: silently training less than asked ruins a run."""
        from polyrl.errors import UserInputError

        wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
        for kind in (k for k, on in wanted.items() if on):
            if not any(k == kind for k, _ in self._linears.values()):
                raise UserInputError(
                    f"train_{kind}: model {self.name!r} ({type(self.hf_model).__name__}) has no {kind} "
                    f"layers that LoRA can train (linear layers or fused expert weights); "
                    f"set train_{kind} to false"
                )
        chosen = [(name, how) for name, (kind, how) in self._linears.items() if wanted[kind]]
        if not chosen:
            raise UserInputError(f"LoRA spec {spec} selects no layers of model {self.name!r}")
        return {
            "target_modules": [name for name, how in chosen if how == "module"],
            "target_parameters": [name for name, how in chosen if how == "parameter"],
        }

    def add_adapter(self, adapter: str, spec: LoraSpec) -> list[torch.nn.Parameter]:
        """Create adapter ``adapter`` (B=0, A random from ``spec.seed``) and return its parameters."""
        from peft import LoraConfig, get_peft_model

        from polyrl.local.lora import fuse

        config = LoraConfig(
            r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none", **self.lora_targets(spec)
        )
        seed = spec.seed if spec.seed is not None else int.from_bytes(os.urandom(4), "little")
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            if self.peft_model is None:
                self.peft_model = get_peft_model(self.hf_model, config, adapter_name=adapter)
            else:
                self.peft_model.add_adapter(adapter, config)
        fuse(self.peft_model)
        self._adapter_specs[adapter] = spec
        params = self.adapter_params(adapter)
        for p in params:
            p.data = p.data.float()  # adapters train in float32 whatever the base dtype
        return params

    def adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        marker = f".{adapter}."
        named = [(n.replace(marker, "."), p) for n, p in self.peft_model.named_parameters() if marker in n]
        return [p for _, p in sorted(named, key=lambda item: item[0])]

    def delete_adapter(self, adapter: str) -> None:
        if self.peft_model is not None and adapter in self._adapter_specs:
            self.peft_model.delete_adapter(adapter)
            del self._adapter_specs[adapter]

    def snapshot(self, adapter: str) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.adapter_params(adapter)]

    @contextlib.contextmanager
    def use(self, adapter: str | None, train: bool = False) -> Iterator[torch.nn.Module]:
        """The model with ``adapter`` active (``None``: the bare base model)."""
        if adapter is None:
            if self.peft_model is None or not self._adapter_specs:  # no adapter (left)
                yield self.hf_model
                return
            if self.peft_model.active_adapter not in self._adapter_specs:
                # once the last adapter is deleted PEFT keeps naming it active, and disable_adapter()
                # looks it up
                self.peft_model.set_adapter(next(iter(self._adapter_specs)))
            with self.peft_model.disable_adapter():
                yield self.peft_model
            return
        # through PeftModel, so its own ``active_adapter`` follows too (it otherwise keeps naming the first
        # adapter ever added, which breaks forward once that one is deleted, e.g. after load_sampler)
        self.peft_model.set_adapter(adapter)
        params = self.adapter_params(adapter)
        for p in params:
            p.requires_grad_(train)
        yield self.peft_model

    def load_snapshot(self, spec: LoraSpec, weights: list[torch.Tensor], owner: object,
                      lane: str = "") -> str:
        """Copy snapshot ``weights`` into the sampling slot for ``spec``'s shape and ``lane`` (the engine's
        owner of the work: each API key of a shared server samples in slots of its own, so keys taking turns
        do not fold their weights into the sampling model again at every turn); return its name.

        The copy is skipped when the slot already holds ``owner``'s weights."""
        key = (*spec.shape_key, lane)
        slot = self._sampling_slots.get(key)
        if slot is None:
            slot = f"sampler_{next(self._slot_names)}"
            self.add_adapter(slot, LoraSpec(spec.rank, spec.train_mlp, spec.train_attn, spec.train_unembed,
                                            seed=0))
            self._sampling_slots[key] = slot
        if self._slot_owner.get(slot) is not owner:
            with torch.no_grad():
                for dst, src in zip(self.adapter_params(slot), weights, strict=True):
                    dst.copy_(src)
            self._slot_owner[slot] = owner
        return slot

    def release_snapshot(self, owner: object) -> int:
        """Give back the sampling slots holding ``owner``'s weights (a sampling client that is gone): the
        slot's adapter, the folded weights made from it, and the reference to ``owner`` that kept its
        snapshot alive. Slots are made per adapter shape, so without this every LoRA shape ever sampled
        would keep a slot (and, with merged sampling, a folded copy of the weights it adapts) for the
        server's life. A sampler that samples again gets a new slot. Returns the number of slots freed."""
        freed = [(key, slot) for key, slot in self._sampling_slots.items()
                 if self._slot_owner.get(slot) is owner]
        for key, slot in freed:
            del self._sampling_slots[key]
            self._slot_owner.pop(slot, None)
            self._merged.pop(slot, None)
            if self.sampler_copy is not None:
                self.sampler_copy.forget(slot)
            self.delete_adapter(slot)
        return len(freed)

    # ---- sampling ---------------------------------------------------------------------------
    @property
    def sampler_note(self) -> str:
        """One line: the sampler's and the learner's dtypes, why, and the memory of the sampler's copy."""
        return describe(self.sampler_dtype, self.sampler_reason, self.dtype, self.dtype_reason,
                        self.sampler_bytes)

    @property
    def sampler_bytes(self) -> int:
        """Memory the sampler holds beside the learner's weights: its copy, with the snapshots folded in."""
        return self.sampler_copy.nbytes if self.sampler_copy is not None else 0

    @property
    def sampler_decode_step(self):
        """A one-token decode step for the sampling model, faster than its forward where there is one."""
        return self.sampler_copy.fast_step if self.sampler_copy is not None else None

    def sampler_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states of the model :meth:`use_for_sampling` gives."""
        return self.sampler_copy.logits(hidden) if self.sampler_copy is not None else self.logits(hidden)

    @contextlib.contextmanager
    def use_for_sampling(self, slot: str | None) -> Iterator[torch.nn.Module]:
        """The model to sample from, with sampling slot ``slot``'s adapter (``None``: the bare base model).

        With a sampler copy in its own dtype, the copy with the snapshot folded in. Otherwise the learner's
        model, the adapter folded into its weights when affordable (:data:`MERGED_SAMPLING_MAX_BYTES`): each
        adapted layer's base weight is swapped for ``W + scale * B @ A`` (computed once per snapshot) while
        the adapters are disabled."""
        if self.sampler_copy is not None:
            owner = self._slot_owner.get(slot) if slot is not None else None
            with self.sampler_copy.use(slot, owner, lambda: self._merge_targets(slot)) as model:
                yield model
            return
        if slot is None:
            with self.use(None) as model:
                yield model
            return
        merged = self._merged_weights(slot)
        if merged is None:
            with self.use(slot) as model:
                yield model
            return
        originals = [(layer.base_layer, layer.base_layer._parameters["weight"]) for layer, _ in merged]
        try:
            for layer, weight in merged:
                layer.base_layer._parameters["weight"] = weight
            with self.use(None) as model:
                yield model
        finally:
            for base_layer, weight in originals:
                base_layer._parameters["weight"] = weight

    def _merge_targets(self, slot: str) -> list[MergeTarget]:
        """Every weight sampling slot ``slot``'s adapter changes, named as in the bare model."""
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora.layer import ParamWrapper

        from polyrl.local.lora import add_delta

        targets = []
        for name, m in self.peft_model.named_modules():
            if not (hasattr(m, "lora_A") and slot in m.lora_A):
                continue
            path = ".".join(p for p in name.removeprefix("base_model.model.").split(".") if p != "base_layer")
            if isinstance(m, ParamWrapper):  # fused expert weights; wrappers of one module nest
                targets.append(MergeTarget(path, m.parameter_name, functools.partial(add_delta, m, slot)))
            elif isinstance(m, LoraLinear):
                targets.append(MergeTarget(path, "weight", functools.partial(add_delta, m, slot)))
            else:
                raise ValueError(f"cannot fold the LoRA of {name} ({type(m).__name__}) into the sampler's "
                                 "weights")
        return targets

    def _merged_weights(self, slot: str) -> list[tuple[torch.nn.Module, torch.nn.Parameter]] | None:
        from peft.tuners.lora import Linear as LoraLinear

        from polyrl.local.lora import add_delta

        owner = self._slot_owner.get(slot)
        cached = self._merged.get(slot)
        if cached is not None and cached[0] is owner:
            return cached[1]
        layers = [m for m in self.peft_model.modules() if hasattr(m, "lora_A") and slot in m.lora_A]
        if not layers or not all(isinstance(m, LoraLinear) for m in layers):  # e.g. MoE expert parameters
            return None
        size = sum(m.base_layer.weight.numel() * m.base_layer.weight.element_size() for m in layers)
        if size > MERGED_SAMPLING_MAX_BYTES:
            return None
        buffers = {id(m): w for m, w in (cached[1] if cached else [])}
        merged = []
        with torch.no_grad():
            for m in layers:
                base = m.base_layer.weight
                weight = buffers.get(id(m))
                if weight is None:
                    weight = torch.nn.Parameter(torch.empty_like(base), requires_grad=False)
                weight.copy_(base)
                add_delta(m, slot, weight)
                merged.append((m, weight))
        self._merged[slot] = (owner, merged)
        return merged

    # ---- disk format (standard PEFT adapter directories) ----------------------------------
    def save_adapter(self, adapter: str, directory: Path) -> None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save

        state = get_peft_model_state_dict(self.peft_model, adapter_name=adapter, save_embedding_layers=False)
        # serialized in memory (an adapter is small) and written by Python, so that a full disk is an
        # OSError naming the problem rather than a safetensors error
        data = save({k: v.detach().cpu().contiguous() for k, v in state.items()})
        (directory / "adapter_model.safetensors").write_bytes(data)
        config = self.peft_model.peft_config[adapter].to_dict()
        config["base_model_name_or_path"] = self.name
        for key in ("target_modules", "target_parameters"):  # sets in memory; JSON lists on disk
            config[key] = sorted(config[key] or [])
        import json

        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))

    def load_adapter_weights(self, adapter: str, directory: Path) -> None:
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(directory / "adapter_model.safetensors", device=str(self.device))
        result = set_peft_model_state_dict(self.peft_model, state, adapter_name=adapter)
        missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
        if missing:
            raise ValueError(f"checkpoint {directory} does not fit adapter {adapter}: {missing[:3]}")
