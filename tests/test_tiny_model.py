"""Tiny models load offline through the standard Hugging Face classes."""

from __future__ import annotations

import subprocess
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

from polyrl.models.tiny import build_tiny_model
from polyrl.models.tiny_base import ADDED_TOKENS, SPECIAL_TOKENS


def test_tiny_model_loads_with_auto_classes_and_has_chatml(tmp_path):
    out = build_tiny_model(tmp_path / "m", "unit", seed=1)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen3"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    for t in SPECIAL_TOKENS + ADDED_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t  # one token each
    assert set(SPECIAL_TOKENS) <= set(tok.all_special_tokens)
    assert not set(ADDED_TOKENS) & set(tok.all_special_tokens)  # plain added tokens, as in Qwen3
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("What is 12 + 345?")) == "What is 12 + 345?"
    assert [tok.decode([i]) for i in tok.encode("345", add_special_tokens=False)] == ["3", "4", "5"]
    assert model.config.vocab_size == len(tok)


def test_sizes_grow_and_cli_writes_a_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "polyrl.cli", "tiny-model", str(tmp_path / "q"),
                          "--size", "quickstart"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    big = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert 500_000 < sum(p.numel() for p in big.parameters()) < 5_000_000


def test_qwen3_0_6b_size_has_the_real_models_shapes():
    """Checked on the meta device (no weights): Qwen3-0.6B's published config, and its parameter count
    (596,049,920 with the tied embedding: "0.6B", of which 0.44B outside the embedding)."""
    import torch

    from polyrl.models.tiny import SIZES, build_tokenizer, tiny_config

    spec = SIZES["qwen3-0.6b"]
    config, model_class = tiny_config(spec, build_tokenizer(spec.vocab_size))
    real = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}
    assert {k: getattr(config, k) for k in real} == real
    assert config.rope_parameters["rope_theta"] == 1e6
    with torch.device("meta"):
        model = model_class(config)
    total = sum(p.numel() for p in model.parameters())
    assert total == 596_049_920
    assert total - model.get_input_embeddings().weight.numel() == 440_467_456


def test_the_command_lines_help_names_every_size():
    import subprocess
    import sys

    from polyrl.models.gguf import PACKAGED
    from polyrl.models.tiny import SIZES
    from polyrl.models.tiny_vl import VL_SIZES

    out = subprocess.run([sys.executable, "-m", "polyrl.cli", "tiny-model", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    words = out.replace("|", " ").replace(";", " ").replace("(", " ").split()
    assert not [name for name in [*SIZES, *VL_SIZES, *PACKAGED] if name not in words], out
