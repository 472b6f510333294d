"""Images and the protocol's types: two images side by side (positions and logprobs against the plain
Hugging Face model, in process and through ``polyrl serve``), each bad image chunk one 400 line that says
what is wrong with it, strict numbers in every JSON request, and image files named without their content.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import tinker
import torch
from PIL import Image
from test_serve import KEY, PROTO, Served, _fwdbwd_body, _retrieve, _session
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


# ---- what is wrong with an image chunk -----------------------------------------------------------------
def encoded(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(buffer, format=fmt)
    return buffer.getvalue()


def chunk_json(data: bytes | str, fmt: str = "png", expected=4) -> dict:
    text = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "image", "data": text, "format": fmt, "expected_tokens": expected}


BAD_CHUNKS = [  # (what, chunk, words of the one line that answers it)
    ("JPEG as png", chunk_json(encoded("JPEG")), "declares format 'png' but its bytes are a JPEG"),
    ("GIF as png", chunk_json(encoded("GIF")), "declares format 'png' but its bytes are a GIF"),
    ("WebP as png", chunk_json(encoded("WEBP")), "declares format 'png' but its bytes are a WEBP"),
    ("PNG as jpeg", chunk_json(encoded("PNG"), "jpeg"), "declares format 'jpeg' but its bytes are a PNG"),
    ("-3 tokens", chunk_json(RED, "jpeg", -3), "expected_tokens must be a positive count, got -3"),
    ("true tokens", chunk_json(RED, "jpeg", True), "expected_tokens must be a positive count, got True"),
    ("no tokens", chunk_json(RED, "jpeg", None), "needs expected_tokens"),
    ("bad base64", chunk_json("not base64 at all!"), "data is not valid base64"),
    ("gif", chunk_json(encoded("GIF"), "gif"), "format 'gif' is not supported (supported: 'png', 'jpeg')"),
]


def test_each_bad_image_chunk_is_one_400_line_saying_what_is_wrong(served):
    """Over JSON (sampling) and protobuf (forward_backward): the declared format against the bytes'
    signature, a count of tokens that is not one, bad base64, an unsupported format: each a 400 of one line
    that names the chunk and the problem (never another chunk type's missing fields)."""
    http = served.http
    session = http.post("/create_sampling_session", json={
        "session_id": _session(served), "sampling_session_seq_id": 0, "base_model": served.model_dir})
    sampler = session.json()["sampling_session_id"]
    for seq, (what, chunk, words) in enumerate(BAD_CHUNKS):
        body = {"sampling_session_id": sampler, "seq_id": seq, "num_samples": 1,
                "sampling_params": {"max_tokens": 2},
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 342]}, chunk,
                                      {"type": "encoded_text", "tokens": [2]}]}}
        r = http.post("/asample", json=body)
        error = r.json().get("error", "")
        assert r.status_code == 400 and r.json()["category"] == "user", (what, r.status_code, r.text[:300])
        assert words in error and "chunk 1" in error and "\n" not in error, (what, error)
        assert "EncodedTextChunk" not in error and "Field required" not in error, (what, error)
    model = http.post("/create_model", json={"session_id": _session(served), "model_seq_id": 0,
                                             "base_model": served.model_dir, "lora_config": {"rank": 2}})
    model_id = _retrieve(served, model.json()["request_id"])["model_id"]
    for seq, (what, chunk, words) in enumerate(BAD_CHUNKS[:5], start=1):
        datum = types.Datum(model_input=types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=[1, 342]),
            types.ImageChunk(data=base64.b64decode(chunk["data"]), format=chunk["format"],
                             expected_tokens=chunk["expected_tokens"]),
            types.EncodedTextChunk(tokens=[2])]),
            loss_fn_inputs={"target_tokens": types.TensorData(data=[0] * 7, dtype="int64")})
        r = http.post("/forward_backward", content=_fwdbwd_body(model_id, seq, [datum]), headers=PROTO)
        assert r.status_code == 400 and words in r.json()["error"], (what, r.status_code, r.text[:300])
        assert "model_input chunk 1" in r.json()["error"]
    assert served.alive()


def test_the_engine_checks_an_image_chunks_format_against_its_bytes(local, tiny_vl_dir):
    tc = local.create_lora_training_client(tiny_vl_dir, rank=2, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    for data, fmt, found in ((encoded("JPEG"), "png", "JPEG"), (encoded("PNG"), "jpeg", "PNG")):
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 342]),
                                          types.ImageChunk(data=data, format=fmt, expected_tokens=4)])
        datum = types.Datum(model_input=prompt, loss_fn_inputs={
            "target_tokens": types.TensorData(data=[0] * prompt.length, dtype="int64")})
        for call in (lambda: tc.forward([datum], "cross_entropy").result(),
                     lambda: sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()):
            with pytest.raises(ValueError, match=f"chunk 1: the chunk declares format '{fmt}' but its bytes "
                                                 f"are a {found} image"):
                call()


# ---- strict numbers ------------------------------------------------------------------------------------
def test_a_bool_or_a_string_is_never_a_number_in_a_request(served, tiny_vl_dir):
    """``true`` is not a 1-second TTL, ``"2"`` is not two samples: every numeric field of every JSON request
    takes numbers only (a JSON integer still fills a float field); the official SDK's requests pass."""
    sdk = served.sdk(KEY)
    tc = sdk.create_lora_training_client(base_model=tiny_vl_dir, rank=2, seed=0)
    path = tc.save_state("strict-ttl").result().path
    rest = sdk.create_rest_client()
    run_id, name = tc.model_id, path.rsplit("/", 1)[-1]
    ttl = f"/training_runs/{run_id}/checkpoints/weights/{name}/ttl"
    for value in (True, "60", 60.0):
        r = served.http.put(ttl, json={"ttl_seconds": value})
        assert r.status_code == 400 and "ttl_seconds" in r.json()["error"], (value, r.status_code, r.text)
    [row] = [c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == path]
    assert row.expires_at is None  # nothing was set
    assert served.http.put(ttl, json={"ttl_seconds": 60}).status_code == 200

    http = served.http
    sampler = http.post("/create_sampling_session", json={
        "session_id": _session(served), "sampling_session_seq_id": 0, "base_model": served.model_dir})
    sampler = sampler.json()["sampling_session_id"]
    good = {"sampling_session_id": sampler, "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 342]}]}}
    bad = [("num_samples", {"num_samples": "2"}), ("num_samples", {"num_samples": True}),
           ("sampling_params.max_tokens", {"sampling_params": {"max_tokens": True}}),
           ("sampling_params.temperature", {"sampling_params": {"max_tokens": 2, "temperature": "1"}}),
           ("sampling_params.seed", {"sampling_params": {"max_tokens": 2, "seed": False}}),
           ("prompt.chunks.0.tokens.1",
            {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, True]}]}}),
           ("seq_id", {"seq_id": "3"}), ("topk_prompt_logprobs", {"topk_prompt_logprobs": True})]
    for seq, (field, change) in enumerate(bad, start=1):
        r = http.post("/asample", json={**good, "seq_id": seq, **change})
        error = r.json().get("error", "")
        assert r.status_code == 400 and error.startswith(f"invalid request body: {field}: "), (change, error)
        assert "ImageChunk" not in error, error
    model = http.post("/create_model", json={"session_id": _session(served), "model_seq_id": 0,
                                             "base_model": served.model_dir, "lora_config": {"rank": True}})
    assert model.status_code == 400 and "lora_config.rank" in model.json()["error"], model.text
    r = http.post("/asample", json={**good, "seq_id": 100,
                                    "sampling_params": {"max_tokens": 2, "temperature": 1}})
    assert r.status_code == 200 and len(_retrieve(served, r.json()["request_id"])["sequences"]) == 1
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        tc.save_state("strict-zero", ttl_seconds=0).result(timeout=60)


# ---- image files ---------------------------------------------------------------------------------------
def test_an_image_file_that_is_not_an_image_is_named_never_shown(tmp_path):
    """The error names the file and what is wrong with it, and holds nothing of what the file holds."""
    secret = tmp_path / "hostname"
    secret.write_bytes(b"vm-secret-box\n")
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for source, path, words in ((str(secret), secret, "not an image in a known format"),
                                (f"file://{secret}", secret, "not an image"),
                                ({"path": str(secret)}, secret, "not an image"),
                                (str(folder), folder, "not a regular file")):
        with pytest.raises(images.ImageError) as e:
            images.read_image(source)
        message = str(e.value)
        assert words in message and repr(str(path)) in message and "secret-box" not in message, message
    with pytest.raises(images.ImageError) as e:
        images.decoded_parts([{"role": "user", "content": [{"type": "image", "image": str(secret)}]}])
    assert repr(str(secret)) in str(e.value) and "secret-box" not in str(e.value)
    with pytest.raises(images.ImageError) as e:
        images.decode(b"vm-secret-box\n")
    assert "secret" not in str(e.value) and "14 bytes" in str(e.value)
