"""Images and the protocol's types: two images side by side (positions and logprobs against the plain
Hugging Face model, in process and through ``polyrl serve``), each bad image chunk one 400 line that says
what is wrong with it, strict numbers in every JSON request, and image files named without their content.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_serve import KEY, Served
from test_vision_engine import Seq, jpeg
from tinker import types

from polyrl import images
from polyrl.local import ServiceClient

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

RED, BLUE = jpeg((220, 30, 30)), jpeg((30, 70, 220), size=(96, 64))


@pytest.fixture(scope="module")
def served(tiny_vl_dir, tmp_path_factory):
    s = Served(tiny_vl_dir, tmp_path_factory.mktemp("images-protocol-store"), "--long-poll", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def processor(tiny_vl_dir):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(tiny_vl_dir)


@pytest.fixture(scope="module")
def plain(tiny_vl_dir):
    """The plain Hugging Face model: nothing of polyrl's positions, packing or image handling."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return ServiceClient(store_dir=tmp_path_factory.mktemp("images-protocol-local"))


@pytest.fixture(scope="module")
def side_by_side(vl_tokenizer, processor) -> Seq:
    """Text, two pictures of different sizes with nothing between them, text."""
    pad = vl_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return Seq(pad, processor).text([1, 342, 205]).image(RED).image(BLUE).text([400, 17, 93, 250, 8])


# ---- two images side by side ---------------------------------------------------------------------------
def plain_positions(plain, seq: Seq, processor) -> torch.Tensor:
    """``[3, T]`` positions of ``seq`` composed from the model's own rope index of each image alone: each
    image's grid placed where the piece before it ended, text continuing from the largest position."""
    inner = plain.model
    parts, at, next_position = [], 0, 0
    for span in seq.spans:
        text = span.start - at
        parts.append(torch.arange(text).expand(3, -1) + next_position)
        next_position += text
        grid = processor(images=[images.decode(span.data)], return_tensors="pt")["image_grid_thw"]
        alone, _ = inner.get_rope_index(torch.zeros(1, span.length, dtype=torch.long),
                                        mm_token_type_ids=torch.ones(1, span.length, dtype=torch.int32),
                                        image_grid_thw=grid)
        parts.append(alone[:, 0] + next_position)
        next_position = int(parts[-1].max()) + 1
        at = span.end
    parts.append(torch.arange(len(seq.tokens) - at).expand(3, -1) + next_position)
    return torch.cat(parts, dim=1)


def plain_logprobs(plain, processor, seq: Seq, tokens: list[int]) -> torch.Tensor:
    """Logprobs of ``tokens[1:]`` after ``tokens[:-1]`` (``seq``'s pictures at its places), by the plain
    model on its processor's pixels and :func:`plain_positions`."""
    ids = torch.tensor([tokens[:-1]])
    out = processor(images=[images.decode(s.data) for s in seq.spans], return_tensors="pt")
    whole = Seq(seq.pad, processor)
    whole.tokens, whole.spans = list(tokens[:-1]), seq.spans
    positions = plain_positions(plain, whole, processor)[:, None]  # [3, 1, T]
    with torch.no_grad():
        logits = plain(input_ids=ids, position_ids=positions, pixel_values=out["pixel_values"],
                       image_grid_thw=out["image_grid_thw"]).logits[0].float()
    targets = torch.tensor(images.without_images(tokens, seq.spans)[1:])  # 0 at pictures, as datums hold
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def test_two_images_side_by_side_take_the_models_own_positions(local, tiny_vl_dir, plain, processor,
                                                               side_by_side):
    """Each picture keeps its own grid, as the model's rope index places an image; with text between the
    pictures the positions are exactly the rope index's own on the whole sequence."""
    vision = local.create_lora_training_client(tiny_vl_dir, rank=2, seed=0).result()._state.base.vision
    for seq in (side_by_side, side_by_side.copy().text([301]).image(RED).text([302])):
        tokens, found = vision.read_chunks(seq.datum().model_input.chunks, "prompt")
        got, delta = vision.rope(tokens, found)
        want = plain_positions(plain, seq, processor)[:, :len(tokens)]  # the datum's input: all but the last
        assert torch.equal(got, want), (got, want)
        assert delta == int(want.max()) + 1 - len(tokens)
    separated = side_by_side.copy()
    separated.tokens.insert(separated.spans[1].start, 303)
    separated.spans[1] = separated.spans[1].shifted(1)
    tokens, found = vision.read_chunks(separated.datum().model_input.chunks, "prompt")
    ids = torch.tensor([tokens])
    grids = torch.stack([image.grid_thw for image in found])
    own, own_delta = plain.model.get_rope_index(ids, mm_token_type_ids=(ids == separated.pad).int(),
                                                image_grid_thw=grids)
    got, delta = vision.rope(tokens, found)
    assert torch.equal(got, own[:, 0]) and delta == int(own_delta.reshape(-1)[0])


def test_two_images_side_by_side_give_the_plain_models_logprobs(local, served, tiny_vl_dir, plain, processor,
                                                                side_by_side):
    """forward, forward_backward and sample, in process and through ``polyrl serve`` with the official SDK,
    on a prompt of two pictures side by side: the plain model's logprobs (a new adapter adds nothing)."""
    datum = side_by_side.datum()
    want = plain_logprobs(plain, processor, side_by_side, side_by_side.tokens)
    prompt = images.model_input(side_by_side.tokens, side_by_side.spans)
    for service in (local, served.sdk(KEY)):
        tc = service.create_lora_training_client(base_model=tiny_vl_dir, rank=2, seed=0).result()
        for out in (tc.forward([datum], "cross_entropy").result(),
                    tc.forward_backward([datum], "cross_entropy").result()):
            got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
            np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
        sampler = tc.save_weights_and_get_sampling_client().result()
        sample = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=3)).result()
        for seq in sample.sequences:
            tokens = side_by_side.tokens + list(seq.tokens)
            sampled = plain_logprobs(plain, processor, side_by_side, tokens)[-len(seq.tokens):]
            np.testing.assert_allclose(seq.logprobs, sampled.numpy(), atol=1e-4)
