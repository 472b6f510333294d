"""Which sampler the local engine uses (``local.sampler``) and where vLLM is: the light half of the vLLM
sampler (:mod:`polyrl.local.vllm`), which config checks and ``polyrl serve``'s argument checks read without
loading the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from polyrl.errors import UserInputError

DEFAULT_PYTHON = ".venv-vllm/bin/python"  # where `make vllm` builds vLLM's environment


class VllmStartError(UserInputError):
    """A vLLM server could not start (no interpreter, no vLLM, no memory, an unsupported model)."""


@dataclass(frozen=True)
class VllmSettings:
    """How the engine reaches vLLM: ``urls`` of servers that already run, else a process it starts from
    ``python``. ``gpu_memory_utilization`` is the share of the GPU's memory (on a CPU: of the host's) vLLM
    reserves; ``None``: 0.4 on a GPU (the learner shares it), 0.1 on a CPU. ``restarts`` bounds how often a
    started server that died is started again; ``start_timeout_s`` how long a start may take."""

    python: str = DEFAULT_PYTHON
    urls: tuple[str, ...] = ()
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_lora_rank: int = 64
    restarts: int = 3
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0


def resolve_sampler(sampler: str, device: str, settings: VllmSettings) -> str:
    """``polyrl`` or ``vllm`` for the ``local.sampler`` setting: ``auto`` is vLLM when servers are given by
    URL, or on a CUDA device when vLLM's interpreter exists; polyrl's own sampler otherwise (on a CPU it
    is the faster: docs/guides/vllm.md)."""
    if sampler != "auto":
        return sampler
    if settings.urls:
        return "vllm"
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "vllm" if cuda and Path(find_python(settings.python)).exists() else "polyrl"


def find_python(python: str) -> str:
    """``python`` as given; the default, when the working directory has none, in polyrl's own checkout
    (where `make vllm` put it)."""
    if python == DEFAULT_PYTHON and not Path(python).exists():
        beside = Path(__file__).resolve().parents[1] / DEFAULT_PYTHON
        if beside.exists():
            return str(beside)
    return python


def check_python(python: str) -> None:
    """The interpreter exists: else one line saying how to make it."""
    python = find_python(python)
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        hint = " (`make vllm` builds it)" if python == DEFAULT_PYTHON else ""
        raise VllmStartError(f"vLLM's interpreter {python} does not exist{hint}; set local.vllm.python "
                             "(serve: --vllm-python) to the python of an environment with vLLM, or give "
                             "servers that run with local.vllm.urls (--vllm-url)")
