"""The local engine with a vision-language model (the tiny Qwen3-VL): image chunks through forward,
forward_backward (every loss), sample and compute_logprobs, against an independent reference.

The reference is a plain Hugging Face model (``AutoModelForImageTextToText``) with the PEFT adapter loaded
from the engine's own checkpoint directory, run datum by datum on the model's own processor outputs
(``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) and computing its own multimodal positions:
nothing of polyrl's packing, chunking, position or image handling is in it.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image
from test_local_engine import (
    LOSS_NAMES,
    adam,
    assert_grads_close,
    checkpoint_dir,
    f32,
    from_state,
    make_datum,
    out_logprobs,
    reference_loss,
    take_grads,
    with_inputs,
)
from tinker import types

from polyrl import images
from polyrl.local import ServiceClient

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


# ---- helpers -------------------------------------------------------------------------------------------
def jpeg(colour, size=(64, 64), shape: bool = True) -> bytes:
    """A picture (a square of ``colour`` on white, or a plain field) in the canonical encoding."""
    image = Image.new("RGB", size, (255, 255, 255) if shape else colour)
    if shape:
        image.paste(colour, (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4))
    return images.encode(image)


def image_tokens(data: bytes, processor) -> int:
    grid = processor(images=[images.decode(data)], return_tensors="np")["image_grid_thw"]
    return int(np.prod(grid)) // processor.merge_size**2


class Seq:
    """A token sequence with images: text ids and (position, encoded image) placements."""

    def __init__(self, pad: int, processor):
        self.pad, self.processor = pad, processor
        self.tokens: list[int] = []
        self.spans: list[images.ImageSpan] = []

    def text(self, ids: list[int]) -> "Seq":
        self.tokens += list(ids)
        return self

    def image(self, data: bytes) -> "Seq":
        n = image_tokens(data, self.processor)
        self.spans.append(images.ImageSpan(len(self.tokens), n, data))
        self.tokens += [self.pad] * n
        return self

    def copy(self) -> "Seq":
        out = Seq(self.pad, self.processor)
        out.tokens, out.spans = list(self.tokens), list(self.spans)
        return out

    def datum(self, **floats) -> types.Datum:
        model_input, targets = images.next_token_inputs(self.tokens, self.spans)
        inputs = {"target_tokens": types.TensorData(data=targets, dtype="int64")}
        inputs.update({k: f32(v) for k, v in floats.items()})
        return types.Datum(model_input=model_input, loss_fn_inputs=inputs)


def ref_logprobs(ref, processor, d: types.Datum) -> torch.Tensor:
    """Target logprobs of ``d`` by the plain model on its processor's outputs (the model positions itself)."""
    pad = ref.config.image_token_id
    tokens, pictures = [], []
    for chunk in d.model_input.chunks:
        if chunk.type == "encoded_text":
            tokens += list(chunk.tokens)
        else:
            pictures.append(images.decode(chunk.data))
            tokens += [pad] * chunk.expected_tokens
    ids = torch.tensor([tokens])
    kwargs = {}
    if pictures:
        out = processor(images=pictures, return_tensors="pt")
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                  "mm_token_type_ids": (ids == pad).int()}
    ref.base_model.model.model.rope_deltas = None  # no state from an earlier call
    logits = ref(input_ids=ids, **kwargs).logits[0].float()
    targets = d.loss_fn_inputs["target_tokens"].to_torch().long().reshape(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def ref_grads(ref, processor, data, coefs) -> dict[str, torch.Tensor]:
    ref.zero_grad(set_to_none=True)
    total = sum((c.float() * ref_logprobs(ref, processor, d)).sum() for d, c in zip(data, coefs))
    total.backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in ref.named_parameters() if p.requires_grad}


# ---- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("vl-store")


@pytest.fixture(scope="module")
def service(store) -> ServiceClient:
    return ServiceClient(store_dir=store)


@pytest.fixture(scope="module")
def processor(tiny_vl_dir):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(tiny_vl_dir)


@pytest.fixture(scope="module")
def make(vl_tokenizer, processor):
    pad = vl_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return lambda: Seq(pad, processor)


@pytest.fixture(scope="module")
def warm(service, store, tiny_vl_dir, make):
    """A trained adapter (A and B nonzero) on image datums, and the independent reference model."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    tc = service.create_lora_training_client(tiny_vl_dir, rank=4, seed=3).result()
    gen = torch.Generator().manual_seed(1)
    data = [make().text([1, 342, 205]).image(jpeg(c)).text(ints(gen, 6)).datum()
            for c in ((220, 30, 30), (30, 70, 220))]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam(0.02))
    path = tc.save_state("warm").result().path
    base = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, str(checkpoint_dir(store, path)), is_trainable=True)
    ref.eval()
    return {"path": path, "ref": ref}


def ints(gen, n: int, vocab: int = 700) -> list[int]:
    return torch.randint(6, vocab, (n,), generator=gen).tolist()


def image_batch(make, gen) -> list[types.Datum]:
    """GRPO-shaped groups sharing a picture and prompt, the same prompt with another picture, a
    two-picture multi-turn episode whose later datum extends the earlier one, and a text-only datum."""
    red, blue, green = jpeg((220, 30, 30)), jpeg((30, 70, 220)), jpeg((30, 160, 60), size=(96, 64))
    prompt = ints(gen, 5)
    seqs = []
    for picture in (red, blue):
        head = make().text([1, 342, 205]).image(picture).text(prompt)
        seqs += [head.copy().text(ints(gen, int(torch.randint(2, 7, (1,), generator=gen)))) for _ in range(3)]
    turn1 = make().text([1, 342, 205]).image(green).text(ints(gen, 4))
    turn2 = turn1.copy().text(ints(gen, 3)).image(red).text(ints(gen, 5))
    seqs += [turn1, turn2, make().text(ints(gen, 9))]
    return [s.datum() for s in seqs]


def rl_inputs(tc, data, gen) -> list[types.Datum]:
    lps = out_logprobs(tc.forward(data, "cross_entropy").result())
    out = []
    for d, lp in zip(data, lps):
        adv = torch.randn(len(lp), generator=gen)
        adv[: len(lp) // 3] = 0.0
        out.append(with_inputs(d, logprobs=lp + 0.3 * torch.randn(len(lp), generator=gen), advantages=adv,
                               weights=torch.rand(len(lp), generator=gen)))
    return out


# ---- loading -------------------------------------------------------------------------------------------
def test_lora_adapts_the_language_model_and_never_the_vision_tower(service, tiny_vl_dir):
    tc = service.create_lora_training_client(tiny_vl_dir, rank=2, seed=0).result()
    base = tc._state.base
    assert base.vision is not None and type(base.hf_model).__name__ == "Qwen3VLForConditionalGeneration"
    targets = base.lora_targets(tc._state.spec)["target_modules"]
    assert targets and all("language_model" in t or t == "lm_head" for t in targets), targets
    trained = [n for n, p in base.peft_model.named_parameters() if p.requires_grad or "lora_" in n]
    assert trained and not [n for n in trained if ".visual." in n]
    assert base.max_context_length == 4096 and base.split_head


# ---- exactness -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_shared_prefix_packing_with_images_matches_the_model_alone(service, warm, make, processor, loss_fn):
    """Packed (a group's picture and prompt computed once; another picture never shared), the logprobs,
    the loss and the gradients are the plain model's, datum by datum, to 1e-5."""
    from polyrl.local.packing import pack_rows
    from polyrl.local.vision import keyed

    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(7)
    data = rl_inputs(tc, image_batch(make, gen), gen)
    base = tc._state.base
    keys: dict = {}
    read = [base.vision.read_chunks(d.model_input.chunks, "x") for d in data]
    rows = pack_rows([keyed(t, found, keys) for t, found in read], 4096)
    assert sum(len(r) for r in rows) < 0.75 * sum(d.model_input.length for d in data)  # sharing happened
    assert len({k for k in keys.values()}) == 4  # red, blue, and the episode's green and red

    out = tc.forward_backward(data, loss_fn).result()
    got_lps, got_grads = out_logprobs(out), take_grads(tc)
    ref = warm["ref"]
    with torch.no_grad():
        want_lps = [ref_logprobs(ref, processor, d) for d in data]
    for got, want in zip(got_lps, want_lps):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    loss, coefs = reference_loss(loss_fn, [lp.double() for lp in want_lps], data, {})
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-5)
    assert_grads_close(got_grads, ref_grads(ref, processor, data, coefs), rtol=1e-5)


def test_every_loss_takes_image_datums(service, warm, make, processor):
    tc = from_state(service, warm["path"])
    gen = torch.Generator().manual_seed(11)
    data = rl_inputs(tc, image_batch(make, gen)[:4], gen)
    with torch.no_grad():
        want = [ref_logprobs(warm["ref"], processor, d).double() for d in data]
    for loss_fn in LOSS_NAMES:
        out = tc.forward_backward(data, loss_fn).result()
        take_grads(tc)
        loss, _ = reference_loss(loss_fn, want, data, {})
        assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-5), loss_fn


def test_chunked_logprobs_and_checkpointing_stay_exact_with_images(service, warm, make, monkeypatch):
    from polyrl.local import compute

    tc = from_state(service, warm["path"])
    base = tc._state.base
    gen = torch.Generator().manual_seed(13)
    data = rl_inputs(tc, image_batch(make, gen), gen)
    results = []
    for chunk_bytes, checkpointing in ((compute.LOGITS_CHUNK_BYTES, False), (4 * base.vocab_size * 3, True)):
        monkeypatch.setattr(compute, "LOGITS_CHUNK_BYTES", chunk_bytes)
        base.gradient_checkpointing = checkpointing
        try:
            lps = out_logprobs(tc.forward_backward(data, "ppo").result())
        finally:
            base.gradient_checkpointing = False
        results.append((lps, take_grads(tc)))
    (lp_a, g_a), (lp_b, g_b) = results
    for a, b in zip(lp_a, lp_b):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert_grads_close(g_b, g_a, rtol=1e-5)


# ---- sampling ------------------------------------------------------------------------------------------
def test_sampler_logprobs_with_images_match_forward(service, warm, make):
    """Prompts with pictures (and one without) sampled in one batch: each sampled token's logprob is the
    one forward computes for it, to the tolerance text has (1e-4); the picture changes the output."""
    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("vl_lp").result()
    gen = torch.Generator().manual_seed(5)
    prompts = [make().text([1, 342, 205]).image(jpeg((220, 30, 30))).text([9, 2, 205]),
               make().text([1, 342, 205]).image(jpeg((30, 70, 220))).text([9, 2, 205]),
               make().text([1, 342, 205]).image(jpeg((30, 160, 60), (96, 64))).text(ints(gen, 3))
               .image(jpeg((240, 200, 20), (64, 96))).text([2, 205]),
               make().text(ints(gen, 7))]
    # seeded: the same draws on every run (the end of the test samples again and compares)
    params = [types.SamplingParams(max_tokens=9, seed=1), types.SamplingParams(max_tokens=9, seed=1),
              types.SamplingParams(max_tokens=14, temperature=0.7, seed=4),
              types.SamplingParams(max_tokens=5, seed=14)]
    futures = [sampler.sample(images.model_input(p.tokens, p.spans), 3, q) for p, q in zip(prompts, params)]
    results = [f.result() for f in futures]
    for prompt, res in zip(prompts, results):
        for seq in res.sequences:
            full = prompt.copy().text(list(seq.tokens))
            forward = tc.forward([full.datum()], "cross_entropy").result()
            lp = out_logprobs(forward)[0][len(prompt.tokens) - 1:]
            torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float32), lp, rtol=0, atol=1e-4)
    # the same seeds, another picture: other tokens (the model reads the pixels)
    assert [list(s.tokens) for s in results[0].sequences] != [list(s.tokens) for s in results[1].sequences]
    # compute_logprobs: the forward's logprobs, None at the first position only; an image position has the
    # model's (finite) logprob of its placeholder, so tinker-cookbook's NLL (logprobs . weights, weight 0
    # there) stays finite
    full = prompts[2].copy().text(list(results[2].sequences[0].tokens))
    got = sampler.compute_logprobs(images.model_input(full.tokens, full.spans)).result()
    want = out_logprobs(tc.forward([full.datum()], "cross_entropy").result())[0]
    image_positions = {k for s in full.spans for k in range(s.start, s.end)}
    assert got[0] is None and all(got[k] is not None and np.isfinite(got[k]) for k in image_positions)
    text = [k for k in range(1, len(got)) if k not in image_positions]
    torch.testing.assert_close(torch.tensor([got[k] for k in text]), want[[k - 1 for k in text]], rtol=0,
                               atol=1e-4)
    # seeded sampling repeats itself
    again = sampler.sample(images.model_input(prompts[0].tokens, prompts[0].spans), 3, params[0]).result()
    assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in results[0].sequences]


def test_stable_reinforce_trains_on_what_was_sampled_from_prompts_with_pictures(service, warm, make):
    """Sequences sampled (and recorded) from prompts with pictures train with ``stable_reinforce``: the
    provenance spans cover the pictures' positions, and after a step that moved the learner off the
    sampler the loss is its documented formula on the recorded sampler logprobs and the learner's. A datum
    with another picture where the sampled prompt had one is refused, naming the position."""
    from test_stable_reinforce import reference, sampled_datum

    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    data, sequences = [], []
    for colour, advantage in (((220, 30, 30), 1.0), ((30, 70, 220), -1.0)):
        prompt = make().text([1, 342, 205]).image(jpeg(colour)).text([9, 2, 205])
        res = sampler.sample(images.model_input(prompt.tokens, prompt.spans), 2,
                             types.SamplingParams(max_tokens=6, seed=3)).result()
        for seq, scale in zip(res.sequences, (1.0, 2.0)):
            data.append(sampled_datum(prompt.tokens, seq, scale * advantage, spans=prompt.spans))
            sequences.append(seq)
    tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(adam(0.05)).result()
    lps = out_logprobs(tc.forward(data, "cross_entropy").result())
    out = tc.forward_backward(data, "stable_reinforce", {"max_ratio": 1.05, "kl_coeff": 0.3}).result()
    take_grads(tc)
    loss, _, truncated = reference(lps, data, types.SampleResponse(sequences=sequences), 1.05, 0.3)
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert out.metrics["sampled_tokens:sum"] == sum(len(seq.tokens) for seq in sequences)
    assert out.metrics["truncated_tokens:sum"] == truncated > 0
    # the blue prompt's sequence, shown the red picture
    chunks = list(data[2].model_input.chunks)
    k = next(i for i, c in enumerate(chunks) if c.type == "image")
    chunks[k] = data[0].model_input.chunks[k]
    swapped = dataclasses.replace(data[2], model_input=types.ModelInput(chunks=chunks))
    with pytest.raises(ValueError, match=r"position 3 holds an image, but sequence .* prompt has another"):
        tc.forward_backward([swapped], "stable_reinforce").result()


def test_the_sampler_never_draws_an_image_placeholder_and_trains_on_what_it_drew(service, tiny_vl_dir,
                                                                               make):
    """An adapter trained until the image placeholder is the likeliest next token: no sample holds one (it
    is filtered out of each draw, as top-k filters), every sampled logprob is still the model's own (what
    forward computes, 1e-4), and the samples train. Drawn, a placeholder would read as a picture with no
    pixels in training ("Image features and image tokens do not match")."""
    tc = service.create_lora_training_client(tiny_vl_dir, rank=4, seed=0).result()
    pad = make().pad
    gen = torch.Generator().manual_seed(2)
    texts = [ints(gen, 8) for _ in range(4)]
    to_pad = [make_datum(t, [pad] * len(t)) for t in texts]
    for _ in range(8):
        tc.forward_backward(to_pad, "cross_entropy")
        tc.optim_step(adam(0.05))
    prompt = make().text([1, 342, 205]).image(jpeg((220, 30, 30))).text([9, 2, 205])
    model_input = images.model_input(prompt.tokens, prompt.spans)
    next_is_pad = types.Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": types.TensorData(data=prompt.tokens[1:] + [pad], dtype="int64")})
    probe = tc.forward([next_is_pad], "cross_entropy").result()
    assert float(out_logprobs(probe)[0][-1].exp()) > 0.5  # the placeholder is the likeliest next token

    sampler = tc.save_weights_and_get_sampling_client("vl_no_pad").result()
    drawn = []
    for params in (types.SamplingParams(max_tokens=6, seed=1), types.SamplingParams(max_tokens=6, seed=2,
                                                                                    top_k=1),
                   types.SamplingParams(max_tokens=6, temperature=0.0)):
        drawn += sampler.sample(model_input, 4 if params.temperature else 1, params).result().sequences
    assert drawn and not [s.tokens for s in drawn if pad in s.tokens]
    data = []
    for seq in drawn:
        full = prompt.copy().text(list(seq.tokens))
        lp = out_logprobs(tc.forward([full.datum()], "cross_entropy").result())[0][len(prompt.tokens) - 1:]
        # relative too: the other tokens' logprobs are large (-16), float32 rounding scales with them
        torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float32), lp, rtol=1e-4, atol=1e-4)
        data.append(full.datum())
    assert all(torch.isfinite(lp).all() for lp in out_logprobs(
        tc.forward_backward(data, "cross_entropy").result()))


# ---- bad input -----------------------------------------------------------------------------------------
def test_bad_image_chunks_are_one_clear_error_each_and_nothing_breaks(service, warm, make, tiny_model_dir):
    from test_vision import png_header

    tc = from_state(service, warm["path"])
    sampler = tc.save_weights_and_get_sampling_client("vl_bad").result()
    good = make().text([1, 342, 205]).image(jpeg((220, 30, 30))).text([9, 2])
    truncated = jpeg((220, 30, 30))[:200]
    cases = {
        "expected_tokens=7 but the model's image processor makes 4 tokens": (jpeg((1, 2, 3)), 7, "jpeg"),
        "50,000 x 50,000 pixels, more than max_image_pixels": (png_header(50_000, 50_000), 4, "png"),
        "16,384 x 16,384 pixels": (png_header(16_384, 16_384, 6), 4, "png"),
        "0 x 0 pixels": (png_header(0, 0), 4, "png"),
        "corrupt or truncated": (truncated, 4, "jpeg"),
    }
    for needle, (data, expected, fmt) in cases.items():
        chunk = types.ImageChunk(data=data, format=fmt, expected_tokens=expected)
        model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 342]), chunk,
                                               types.EncodedTextChunk(tokens=[2, 3])])
        datum = types.Datum(model_input=model_input, loss_fn_inputs={
            "target_tokens": types.TensorData(data=[0] * model_input.length, dtype="int64")})
        for call in (lambda: tc.forward_backward([datum], "cross_entropy").result(),
                     lambda: sampler.sample(model_input, 1, types.SamplingParams(max_tokens=2)).result()):
            with pytest.raises(ValueError) as info:
                call()
            assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
    pointer = types.ModelInput(chunks=[types.ImageAssetPointerChunk(format="png", location="/etc/passwd",
                                                                    expected_tokens=4)])
    with pytest.raises(ValueError, match="'image_asset_pointer' chunk .*send images as ImageChunk"):
        sampler.sample(pointer, 1, types.SamplingParams(max_tokens=2)).result()
    # the placeholder written as text: a picture with no pixels to the model
    as_text = types.ModelInput.from_ints([1, 342, good.pad, 2])
    written = types.Datum(model_input=as_text, loss_fn_inputs={
        "target_tokens": types.TensorData(data=[0] * as_text.length, dtype="int64")})
    for call in (lambda: tc.forward_backward([written], "cross_entropy").result(),
                 lambda: sampler.sample(as_text, 1, types.SamplingParams(max_tokens=2)).result()):
        with pytest.raises(ValueError, match=f"chunk 0 holds token {good.pad}, the model's image or video "
                                             "placeholder; a picture goes in an ImageChunk"):
            call()
    text_model = service.create_lora_training_client(tiny_model_dir, rank=2).result()
    with pytest.raises(ValueError, match="is text-only"):
        text_model.forward([good.datum()], "cross_entropy").result()
    # the engine goes on
    assert len(sampler.sample(images.model_input(good.tokens, good.spans), 2,
                              types.SamplingParams(max_tokens=3)).result().sequences) == 2


def test_memory_per_image_is_bounded_by_the_processor(service, warm, make, processor):
    """A big picture is resized by the model's processor to its pixel budget: a 2,000 x 1,500 photo is as
    many tokens as the processor's max_pixels allow, however large it was."""
    tc = from_state(service, warm["path"])
    big = io.BytesIO()
    Image.new("RGB", (2000, 1500), (10, 20, 30)).save(big, format="JPEG")
    n = image_tokens(big.getvalue(), processor)
    assert n * 4 * 16 * 16 <= processor.size["longest_edge"]
    seq = make().text([1, 342]).image(big.getvalue()).text([2, 3, 4])
    lp = out_logprobs(tc.forward([seq.datum()], "cross_entropy").result())[0]
    assert len(lp) == len(seq.tokens) - 1 and bool(torch.isfinite(lp).all())
