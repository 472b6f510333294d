"""``polyrl export``: a trained checkpoint as files other tools load without polyrl.

Two forms:

- a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's
  key names, ``base_model_name_or_path`` pointing at the base): ``PeftModel.from_pretrained(base, dir)``
  and vLLM's LoRA loader (``LoRARequest(name, id, dir)``) take it as it is;
- ``merged``: the adapter folded into the base weights, a standard Hugging Face model directory with
  the base's tokenizer and chat template (``AutoModelForCausalLM.from_pretrained(dir)`` works offline).

The output is written to a temporary directory beside ``out_dir`` and renamed into place, so an
interrupted export leaves nothing half-written, and an existing ``out_dir`` is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from polyrl.errors import UserInputError
from polyrl.models import resolve_model_path
from polyrl.rl.policy import Policy, resolve_policy


def export_checkpoint(target: str, out_dir: str | Path, merged: bool = False,
                      store_dir: str | None = None) -> Path:
    """Export the checkpoint ``target`` names (see :func:`polyrl.rl.policy.resolve_policy`) to ``out_dir``."""
    policy = resolve_policy(target, store_dir, allow_base=False)
    out = Path(out_dir).expanduser()
    if out.exists():
        raise UserInputError(f"output directory {out} already exists; export never overwrites, "
                             "choose a new one")
    base_path = resolve_model_path(policy.base_model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if merged:
            write_merged(policy, base_path, tmp)
        else:
            write_adapter(policy, base_path, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_adapter(policy: Policy, base_path: str, out: Path) -> None:
    """The checkpoint's adapter as a standalone PEFT directory whose base is ``base_path`` (made absolute
    when it is a local directory, so the adapter loads from anywhere)."""
    assert policy.checkpoint_dir is not None
    shutil.copyfile(policy.checkpoint_dir / "adapter_model.safetensors", out / "adapter_model.safetensors")
    config = json.loads((policy.checkpoint_dir / "adapter_config.json").read_text())
    local = Path(base_path).is_dir()
    config["base_model_name_or_path"] = str(Path(base_path).resolve()) if local else base_path
    config["task_type"] = "CAUSAL_LM"  # PeftModel.from_pretrained then returns a PeftModelForCausalLM
    config["inference_mode"] = True
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def write_merged(policy: Policy, base_path: str, out: Path) -> None:
    """Base weights + LoRA deltas, saved in the base's own dtype with the base's tokenizer.

    A base whose output embedding is tied to the input embedding gets its own copy first when the
    adapter trains the output layer: merging into a tied matrix would change the input embedding too,
    which the adapter never did."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = out / ".adapter"
    adapter.mkdir()
    write_adapter(policy, base_path, adapter)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto")
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    if head.weight is embed.weight and any(t == head_name or t.endswith("." + head_name) for t in targets):
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    shutil.rmtree(adapter)
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(out)
