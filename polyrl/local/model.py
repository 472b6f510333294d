"""A base model in memory with any number of named LoRA adapters (PEFT).

One :class:`BaseModel` per base model per engine: training clients each own an adapter (their own
parameters and optimizer); sampling clients hold *snapshots* of adapter weights, which are copied
into a shared sampling slot before a batch is generated. All methods run on the engine's worker
thread, so switching the active adapter never races.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from polyrl.models import resolve_model_path

LORA_ALPHA = 32


def select_device(device: str = "auto") -> torch.device:
    """``auto`` picks CUDA, then Apple MPS, then CPU."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def select_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on GPUs that support it, float32 elsewhere (CPU math is float32)."""
    if dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


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

    def __init__(self, name: str, device: str = "auto", dtype: str = "auto"):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.name = name
        self.path = resolve_model_path(name)
        self.device = select_device(device)
        self.dtype = select_dtype(dtype, self.device)
        try:
            self.config = AutoConfig.from_pretrained(self.path)
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        except OSError as e:
            raise ValueError(f"model {name!r} could not be loaded: {e}") from None
        model.to(self.device)
        model.eval()  # no dropout: sampler and learner must compute the same logprobs
        model.requires_grad_(False)
        self.hf_model = model
        self.peft_model = None  # created with the first adapter
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._adapter_specs: dict[str, LoraSpec] = {}
        self._sampling_slots: dict[tuple, str] = {}
        self._slot_owner: dict[str, object] = {}
        self._tokenizer = None
        self._linears = self._linear_layers()

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
    def max_context_length(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

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

    def lora_targets(self, spec: LoraSpec) -> dict[str, list[str]]:
        """``target_modules`` and ``target_parameters`` (full names) of the layers ``spec`` trains. A kind
        asked for that matches nothing is an error: silently training less than asked ruins a run."""
        from polyrl.errors import UserInputError

        wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
        for kind in (k for k, on in wanted.items() if on):
            if not any(k == kind for k, _ in self._linears.values()):
                raise UserInputError(
                    f"train_{kind}: model {self.name!r} ({type(self.hf_model).__name__}) has no {kind} layers "
                    f"that LoRA can train (linear layers or fused expert weights); set train_{kind} to false"
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
            ctx = self.peft_model.disable_adapter() if self.peft_model is not None else contextlib.nullcontext()
            with ctx:
                yield self.peft_model if self.peft_model is not None else self.hf_model
            return
        # through PeftModel, so its own ``active_adapter`` follows too (it otherwise keeps naming the first
        # adapter ever added, which breaks forward once that one is deleted, e.g. after load_sampler)
        self.peft_model.set_adapter(adapter)
        params = self.adapter_params(adapter)
        for p in params:
            p.requires_grad_(train)
        yield self.peft_model

    def load_snapshot(self, spec: LoraSpec, weights: list[torch.Tensor], owner: object) -> str:
        """Copy snapshot ``weights`` into the sampling slot for ``spec``'s shape; return its name.

        The copy is skipped when the slot already holds ``owner``'s weights."""
        key = spec.shape_key
        slot = self._sampling_slots.get(key)
        if slot is None:
            slot = f"sampler_{len(self._sampling_slots)}"
            self.add_adapter(slot, LoraSpec(spec.rank, spec.train_mlp, spec.train_attn, spec.train_unembed, seed=0))
            self._sampling_slots[key] = slot
        if self._slot_owner.get(slot) is not owner:
            with torch.no_grad():
                for dst, src in zip(self.adapter_params(slot), weights, strict=True):
                    dst.copy_(src)
            self._slot_owner[slot] = owner
        return slot

    # ---- disk format (standard PEFT adapter directories) ----------------------------------
    def save_adapter(self, adapter: str, directory: Path) -> None:
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        state = get_peft_model_state_dict(self.peft_model, adapter_name=adapter, save_embedding_layers=False)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, directory / "adapter_model.safetensors")
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
