"""Images as content: bounds and encoding (polyrl.images), the tiny Qwen3-VL model, the vision-language
renderers against the model's own processor and tinker-cookbook, episodes and trajectories with images,
the adapters that pass images through, the visual environment, and ``polyrl play`` / ``polyrl chat``."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image
from tinker import types

from polyrl import images
from polyrl.envs.base import Env, Observation, StepResult
from polyrl.errors import UserInputError
from polyrl.renderers import get_renderer
from polyrl.rl.episode import Episode, RolloutSettings, run_episode


# ---- helpers -------------------------------------------------------------------------------------
def png_header(width: int, height: int, color_type: int = 2) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` pixels and whose data is a few bytes: a
    decompression bomb's shape (a 16,384 x 16,384 RGBA one declares 1 GiB of pixels)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def picture(colour=(200, 30, 30), size=(64, 64)) -> Image.Image:
    return Image.new("RGB", size, colour)


BAD_IMAGES = {  # name -> (value, what the one-line error says)
    "1 GB PNG header": (png_header(16384, 16384, color_type=6),
                        "16,384 x 16,384 pixels, more than max_image_pixels"),
    "50,000 x 50,000": (png_header(50_000, 50_000), "50,000 x 50,000 pixels, more than max_image_pixels"),
    "0x0": (png_header(0, 0), "0 x 0 pixels: it has no pixels"),
    "truncated JPEG": (encoded(picture(size=(80, 60)), "JPEG")[:300], "corrupt or truncated"),
    "not an image": (b"hello, world", "not an image in a known format"),
    "empty": (b"", "the image is empty"),
    "too elongated": (encoded(picture(size=(1000, 2))), "more elongated than 200:1"),
    "a URL": ("https://example.com/cat.png", "image URLs are not fetched"),
    "a missing file": ("/nonexistent/cat.png", "cannot read the image file"),
    "bad base64": ("data:image/png;base64,@@@", "not valid base64"),
    "another type": (12345, "an image must be a PIL image"),
}


# ---- polyrl.images ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_each_malformed_or_oversized_image_is_one_clear_error(name):
    value, needle = BAD_IMAGES[name]
    with pytest.raises(images.ImageError) as info:
        images.read_image(value)
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def test_bounds_come_before_pixels_and_are_configurable(tmp_path):
    data = encoded(picture(size=(300, 200)))
    with pytest.raises(images.ImageError, match="more than max_image_bytes=100"):
        images.read_image(data, images.ImageLimits(max_bytes=100))
    big = tmp_path / "big.png"
    big.write_bytes(data)
    with pytest.raises(images.ImageError, match="more than max_image_bytes=100"):  # the file is never read
        images.read_image(str(big), images.ImageLimits(max_bytes=100))
    with pytest.raises(images.ImageError, match="300 x 200 pixels, more than max_image_pixels=50,000"):
        images.read_image(data, images.ImageLimits(max_pixels=50_000))
    # a header declaring 1 GiB is refused in well under the time (and memory) decoding it would take
    assert images.read_image(data).size == (300, 200)


def test_every_accepted_form_gives_the_same_rgb_pixels(tmp_path):
    rgba = Image.new("RGBA", (40, 30), (10, 200, 30, 128))
    png = encoded(rgba)
    path = tmp_path / "x.png"
    path.write_bytes(png)
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    forms = [rgba, png, bytearray(png), str(path), path, f"file://{path}", uri, {"bytes": png, "path": None},
             {"bytes": None, "path": str(path)}]
    decoded = [images.read_image(form) for form in forms]
    assert all(d.mode == "RGB" and d.size == (40, 30) for d in decoded)
    assert all(np.array_equal(np.asarray(d), np.asarray(decoded[0])) for d in decoded)
    # OpenAI's image_url parts and cookbook image parts are both image parts
    parts = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "image", "image": png}]
    messages = images.decoded_parts([{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}])
    content = messages[0]["content"]
    assert [p["type"] for p in content] == ["image", "image", "text"] and content[0]["image"].size == (40, 30)


def test_the_encoding_is_tinker_cookbooks_and_keeps_the_token_count(tiny_vl_dir):
    """The canonical JPEG is byte for byte what tinker-cookbook's image_to_chunk sends; decoding it gives
    the same width and height, so the processor counts the same tokens from it."""
    from tinker_cookbook.renderers.base import image_to_chunk
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_vl_dir)
    for size in [(64, 64), (37, 91), (130, 70)]:
        image = Image.new("RGB", size, (10, 120, 240))
        chunk = image_to_chunk(image, processor)
        assert images.encode(image) == chunk.data and chunk.format == images.ENCODING
        again = images.decode(chunk.data)
        assert again.size == size
        grid = processor(images=[again], return_tensors="np")["image_grid_thw"]
        assert chunk.expected_tokens == int(np.prod(grid)) // processor.merge_size**2
    assert images.content_hash(b"abc") == images.content_hash(b"abc") != images.content_hash(b"abd")
    assert images.stored_name(b"abc", "jpeg") == f"images/{images.content_hash(b'abc')}.jpeg"


def test_model_input_of_any_prefix_keeps_images_whole():
    span = images.ImageSpan(3, 4, b"\xff\xd8jpeg")
    tokens = [1, 2, 3, 9, 9, 9, 9, 5, 6]
    full = images.model_input(tokens, [span])
    assert [c.type for c in full.chunks] == ["encoded_text", "image", "encoded_text"] and full.length == 9
    assert full.chunks[1].expected_tokens == 4 and full.chunks[1].data == b"\xff\xd8jpeg"
    assert images.model_input(tokens, [span], 3).to_ints() == [1, 2, 3]
    assert images.model_input(tokens, [span], 8).length == 8
    with pytest.raises(ValueError, match="cuts the image"):
        images.model_input(tokens, [span], 5)
    model_input, targets = images.next_token_inputs(tokens, [span])
    assert model_input.length == 8 and targets == [2, 3, 0, 0, 0, 0, 5, 6]  # image positions: target 0
    assert images.flatten(full.chunks, 9) == (tokens, [span])


# ---- the tiny vision-language model ----------------------------------------------------------------
def test_the_tiny_vl_model_loads_offline_with_a_real_processor(tiny_vl_dir, vl_tokenizer):
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(tiny_vl_dir)
    assert config.model_type == "qwen3_vl" and config.architectures == ["Qwen3VLForConditionalGeneration"]
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    processor = AutoImageProcessor.from_pretrained(tiny_vl_dir)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil" and processor.patch_size == 16
    for token in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"):
        assert len(vl_tokenizer.encode(token, add_special_tokens=False)) == 1, token
    assert config.image_token_id == vl_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # a 64 x 64 picture is 4 tokens; the model runs on it
    out = processor(images=[picture()], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    prompt = vl_tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>Colour?<|im_end|>\n<|im_start|>assistant\n" in prompt
    ids = vl_tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * 4), return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                   mm_token_type_ids=(ids == config.image_token_id).int()).logits
    assert logits.shape == (1, ids.shape[1], config.text_config.vocab_size) and bool(logits.isfinite().all())


def test_tiny_model_command_builds_the_vl_model(tmp_path):
    out = subprocess.run([sys.executable, "-m", "polyrl.cli", "tiny-model", str(tmp_path / "m"), "--size",
                          "vl-unit"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
            "chat_template.jinja"} <= {p.name for p in (tmp_path / "m").iterdir()}


# ---- renderers ---------------------------------------------------------------------------------------
def vl_renderer(tokenizer, name: str = "qwen3_vl_instruct"):
    return get_renderer(name, tokenizer)


def user_with_image(image, text: str = "What colour is it?") -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def test_the_vl_renderer_matches_the_models_chat_template_and_processor(tiny_vl_dir, vl_tokenizer):
    """The rendered tokens are the model's own chat template with each <|image_pad|> widened to the
    image's token count, as its processor computes it (Qwen3-VL-Instruct's format)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_vl_dir)
    renderer = vl_renderer(vl_tokenizer)
    first, second = picture(size=(64, 64)), picture((0, 0, 250), size=(96, 130))
    messages = [{"role": "system", "content": "Look closely."}, user_with_image(first),
                {"role": "assistant", "content": "red"}, user_with_image(second, "And this one?")]
    rendered = renderer.render_prompt(messages)
    counts = [int(np.prod(processor(images=[im], return_tensors="np")["image_grid_thw"])) // 4
              for im in (first, second)]
    assert [span.length for span in rendered.images] == counts == [4, 12]
    text = vl_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = text.split("<|image_pad|>")
    widened = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    assert rendered.tokens == vl_tokenizer.encode(widened, add_special_tokens=False)
    pad = vl_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert renderer.image_placeholder_id == pad
    assert all(rendered.tokens[s.start:s.end] == [pad] * s.length for s in rendered.images)
    assert rendered.images[0].size() == (64, 64) and rendered.images[1].size() == (96, 130)


def join_text(model_input):
    """``model_input`` with adjacent text chunks joined: polyrl sends each run of text between images as
    one chunk, where the cookbook may split one (``<|vision_start|>`` alone); the tokens are the same."""
    chunks = []
    for chunk in model_input.chunks:
        if chunk.type == "encoded_text" and chunks and chunks[-1].type == "encoded_text":
            chunks[-1] = types.EncodedTextChunk(tokens=[*chunks[-1].tokens, *chunk.tokens])
        else:
            chunks.append(chunk)
    return types.ModelInput(chunks=chunks)


def test_a_hosted_request_is_byte_for_byte_the_cookbooks(tiny_vl_dir, vl_tokenizer):
    """What polyrl sends to sample (the request's ModelInput: chunk order, JPEG bytes, expected_tokens) is
    exactly what tinker-cookbook's renderer builds with the model's image processor (its runs of text
    joined), and expected_tokens is the processor's own count for the bytes sent."""
    from tinker_cookbook import renderers as cookbook
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_vl_dir)
    reference = cookbook.get_renderer("qwen3_vl_instruct", vl_tokenizer, image_processor=processor)
    image = Image.new("RGB", (77, 150), (40, 200, 90))
    ours = images.model_input(*astuple(vl_renderer(vl_tokenizer).render_prompt([user_with_image(image)])))
    theirs = reference.build_generation_prompt([cookbook.Message(role="user", content=[
        cookbook.ImagePart(type="image", image=image),
        cookbook.TextPart(type="text", text="What colour is it?")])])
    params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[1])
    body = lambda prompt: types.SampleRequest(prompt=prompt, sampling_params=params, num_samples=1,  # noqa: E731
                                              base_model="Qwen/Qwen3-VL-8B-Instruct").model_dump_json()
    assert body(ours) == body(join_text(theirs))
    assert [c.type for c in ours.chunks] == ["encoded_text", "image", "encoded_text"]
    chunks = [c for c in ours.chunks if c.type == "image"]
    assert len(chunks) == 1 and chunks[0].format == "jpeg"
    grid = processor(images=[images.decode(chunks[0].data)], return_tensors="np")["image_grid_thw"]
    assert chunks[0].expected_tokens == int(np.prod(grid)) // 4 == 10


def astuple(rendered):
    return rendered.tokens, rendered.images


def test_real_qwen3_vl_processor_settings_count_tokens_as_the_cookbook_does():
    """With Qwen3-VL-8B's processor settings (patch 16, merge 2, 64K..16M pixels), the count the renderer
    announces for odd sizes is the count the processor's own preprocessing produces."""
    from tinker_cookbook.renderers.base import image_to_chunk
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=65536,
                                         max_pixels=16777216, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for size in [(37, 91), (640, 480), (1000, 20), (333, 777)]:
        image = Image.new("RGB", size, (1, 2, 3))
        grid = processor(images=[image], return_tensors="np")["image_grid_thw"]
        assert image_to_chunk(image, processor).expected_tokens == int(np.prod(grid)) // 4, size


def test_text_only_renderers_refuse_images_in_one_line(tokenizer, vl_tokenizer):
    messages = [user_with_image(picture())]
    with pytest.raises(UserInputError, match="renderer 'qwen3' is text-only and cannot show the images"):
        get_renderer("qwen3", tokenizer).render_prompt(messages)
    with pytest.raises(UserInputError, match="hold images: render them with render_prompt"):
        vl_renderer(vl_tokenizer).initial_prompt(messages)
    # text-only conversations render as before through both interfaces
    text = [{"role": "user", "content": "Hello"}]
    renderer = vl_renderer(vl_tokenizer)
    assert renderer.render_prompt(text).tokens == renderer.initial_prompt(text)
    assert renderer.render_prompt(text).images == []


# ---- episodes ------------------------------------------------------------------------------------------
class ReplySampler:
    """A sampling client that replies with the given texts in turn (+ <|im_end|>) and records every
    ModelInput it was asked to continue."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.inputs, self.sequences = tokenizer, list(replies), [], []

    async def sample(self, prompt, num_samples, params):
        self.inputs.append(prompt)
        tokens = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        tokens += [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        seq = types.SampledSequence(stop_reason="stop", sequence_id=f"s{len(self.sequences)}",
                                    tokens_np=np.array(tokens, np.int32),
                                    logprobs_np=np.full(len(tokens), -0.5, np.float32))
        self.sequences.append(seq)
        return types.SampleResponse(sequences=[seq])


class TwoPictures(Env):
    """Shows a picture, then answers with another one (as PNG bytes in a tool-free user turn)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    async def reset(self):
        return Observation([user_with_image(self.first)])

    async def step(self, action):
        if action["content"] == "red":
            return StepResult([user_with_image(encoded(self.second), "And now?")], 0.5, False)
        return StepResult([], 1.0, True, {"success": 1.0})


def settings(**kw) -> RolloutSettings:
    return RolloutSettings(max_turns=4, max_tokens=8, temperature=1.0, timeout=60, **kw)


def test_multi_turn_with_images_is_token_exact_and_never_re_renders_an_image(vl_tokenizer):
    renderer = vl_renderer(vl_tokenizer)
    first, second = picture(size=(64, 64)), picture((0, 0, 250), size=(96, 96))
    sampler = ReplySampler(vl_tokenizer, ["red", "blue"])
    ep = asyncio.run(run_episode(TwoPictures(first, second), Episode("two", "train", 0, 0), renderer, sampler,
                                 settings()))
    assert ep.error is None and ep.reward == 1.5 and len(ep.images) == 2
    # the second sampling request extends the first one exactly: same chunks, the first image's bytes kept
    one, two = sampler.inputs
    assert two.chunks[: len(one.chunks) - 1] == one.chunks[:-1]
    assert [c.expected_tokens for c in two.chunks if c.type == "image"] == [4, 9]
    # the episode's tokens are the supervised rendering of the whole conversation (the sequence extends)
    conversation = [user_with_image(first), {"role": "assistant", "content": "red"},
                    user_with_image(second, "And now?"), {"role": "assistant", "content": "blue"}]
    rendered, weights = renderer.render_supervised(conversation)
    assert rendered.tokens == ep.tokens and [s.data for s in rendered.images] == [s.data for s in ep.images]
    assert [int(w) for w in weights] == ep.action_mask
    # its Datum: the ModelInput holds both images, image positions are targets 0, sampled tokens weigh
    from polyrl.rl.advantages import to_datum

    ep.turn_advantages = [1.0, 1.0]
    datum = to_datum(ep)
    assert [c.type for c in datum.model_input.chunks].count("image") == 2
    assert datum.model_input.length == len(ep.tokens) - 1
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    assert all(targets[s.start - 1:s.end - 1] == [0] * s.length for s in ep.images)
    # stable_reinforce: provenance spans over text and pictures, checked against the sampling requests as
    # the engine records them (each request's prompt, its pictures included)
    from polyrl.local.stability import SequenceRecords, input_positions

    records = SequenceRecords()
    for prompt, seq in zip(sampler.inputs, sampler.sequences, strict=True):
        records.add("key", "run", input_positions(prompt), [(seq.sequence_id, seq.tokens, seq.logprobs)])
    stable = to_datum(ep, "stable_reinforce")
    assert [c.type for c in stable.model_input.chunks].count("image") == 2
    [found] = records.resolve("key", "run", [stable])
    assert int(found.sampled.sum()) == sum(len(seq.tokens) for seq in sampler.sequences)
    assert np.all(found.sampler_logprobs[found.sampled] == -0.5)
    # another picture of the same size in the second one's place: its positions are not what was sampled
    chunks = list(stable.model_input.chunks)
    k = max(i for i, c in enumerate(chunks) if c.type == "image")
    chunks[k] = chunks[k].model_copy(update={"data": encoded(picture((0, 250, 0), size=(96, 96)))})
    swapped = dataclasses.replace(stable, model_input=types.ModelInput(chunks=chunks))
    with pytest.raises(ValueError, match="holds an image, but sequence 's1''s prompt has another image"):
        records.resolve("key", "run", [swapped])
    # messages keep references to the stored images, no pixels and no base64
    refs = [p for p in images.image_parts(ep.messages)]
    assert [r["image"] for r in refs] == [s.name for s in ep.images] and refs[1]["width"] == 96
    assert set(ep.image_files) == {s.name for s in ep.images}
    assert "base64" not in json.dumps(ep.messages)


class BadPicture(Env):
    def __init__(self, value):
        self.value = value

    async def reset(self):
        return Observation([user_with_image(self.value)])

    async def step(self, action):
        return StepResult([], 1.0, True)


@pytest.mark.parametrize("name", ["1 GB PNG header", "50,000 x 50,000", "0x0", "truncated JPEG"])
def test_a_bad_image_fails_its_episode_with_one_line_before_anything_is_sampled(vl_tokenizer, name):
    from polyrl.rl.rollouts import run_group

    value, needle = BAD_IMAGES[name]
    sampler = ReplySampler(vl_tokenizer, ["x"])

    class OneEnv:
        drives_rollouts = False

        def make(self, split, index):
            return BadPicture(value)

    out = asyncio.run(run_group(OneEnv(), [Episode("bad", "train", 0, 0)], vl_renderer(vl_tokenizer), sampler,
                                settings(), [None]))
    assert out[0].failed and out[0].error.startswith("ImageError: ") and needle in out[0].error, out[0].error
    assert sampler.inputs == [] and out[0].tokens == []
    limited = asyncio.run(run_group(OneEnv(), [Episode("bad", "train", 0, 0)], vl_renderer(vl_tokenizer),
                                    sampler, settings(max_image_pixels=100), [None]))
    assert limited[0].failed


def test_trajectories_store_each_image_once_and_refer_to_it(vl_tokenizer, tmp_path):
    from polyrl.rl.step_metrics import episode_row
    from polyrl.tracking.files import RunFiles

    renderer = vl_renderer(vl_tokenizer)
    pic = picture(size=(64, 64))
    episodes = []
    for _ in range(3):  # the same picture in three episodes
        sampler = ReplySampler(vl_tokenizer, ["blue"])
        episode = Episode("two", "train", 0, 0)
        played = run_episode(TwoPictures(pic, pic), episode, renderer, sampler, settings())
        episodes.append(asyncio.run(played))
    files = RunFiles(tmp_path / "run")
    for ep in episodes:
        files.save_images(ep.image_files)
    files.log_trajectories(0, [episode_row(0, ep, vl_tokenizer, dropped=False) for ep in episodes])
    stored = list((tmp_path / "run" / "images").iterdir())
    assert len(stored) == 1 and stored[0].name == episodes[0].images[0].name.split("/")[1]
    assert images.decode(stored[0].read_bytes()).size == (64, 64)
    text = (tmp_path / "run" / "trajectories" / "step_000000.jsonl").read_text()
    row = json.loads(text.splitlines()[0])
    assert row["images"] == [{"start": 4, "length": 4, "image": episodes[0].images[0].name}]
    assert row["messages"][0]["content"][0] == {"type": "image", "image": episodes[0].images[0].name,
                                                "width": 64, "height": 64}
    assert len(text) < 20_000 and "base64" not in text and "/9j/" not in text  # no JPEG inline


def test_the_renderer_of_a_qwen3_vl_directory_is_inferred(tiny_vl_dir, vl_tokenizer):
    from polyrl.renderers import infer_renderer

    assert infer_renderer(tiny_vl_dir, vl_tokenizer) == "qwen3_vl_instruct"
    assert infer_renderer("Qwen/Qwen3-VL-30B-A3B-Instruct", vl_tokenizer) == "qwen3_vl_instruct"


# ---- the visual environment ------------------------------------------------------------------------------
def test_the_visual_environment_draws_tasks_deterministically_and_holds_out_its_test_split():
    from polyrl.envs.builtin.visual import COLOURS, VisualBuilder, grade

    builder = VisualBuilder({"kinds": ["colour", "count"], "demo_error_rate": 0.5}, seed=3)
    again = VisualBuilder({"kinds": ["colour", "count"], "demo_error_rate": 0.5}, seed=3)
    train = [builder.task("train", i) for i in range(200)]
    test = [builder.task("test", i) for i in range(60)]
    assert train[:20] == [again.task("train", i) for i in range(20)]
    assert not {t.key() for t in train} & {t.key() for t in test}
    assert {t.kind for t in train} == {"colour", "count"}
    assert np.array_equal(np.asarray(train[0].image()), np.asarray(again.task("train", 0).image()))
    for task in train[:50]:
        image = task.image()
        assert image.size == (64, 64)
        if task.kind == "colour":  # the largest shape's colour covers the most non-white pixels
            pixels = np.asarray(image).reshape(-1, 3)
            counts = {name: int((pixels == rgb).all(1).sum()) for name, rgb in COLOURS.items()}
            assert max(counts, key=counts.get) == task.answer
        else:
            assert 1 <= int(task.answer) <= 4
        assert grade(task, f"\\boxed{{{task.answer}}}") == (1.0, True)
        assert grade(task, "no idea") == (0.0, False)
    # demonstrations: the designed mistake at the set rate, on the same picture
    demos = [builder.demonstration("train", i) for i in range(200)]
    wrong = [grade(t, m[1]["content"])[0] == 0 for t, (m, _) in zip(train, demos)]
    assert 0.4 < sum(wrong) / len(wrong) < 0.6
    colour = next(i for i, t in enumerate(train) if t.kind == "colour" and wrong[i])
    assert demos[colour][0][1]["content"] == "\\boxed{white}"
    assert demos[0][0][0]["content"][0]["type"] == "image"
    with pytest.raises(ValueError, match="kinds must be a non-empty list"):
        VisualBuilder({"kinds": ["shade"]})


def test_playing_the_visual_environment_shows_the_image_path_and_size(tiny_vl_dir, tmp_path, capsys):
    from test_export_chat_play import Typed, _play_args

    from polyrl.envs.builtin.visual import VisualBuilder
    from polyrl.interactive import Screen, run_play

    answer = VisualBuilder({}, seed=0).task("train", 2).answer
    typed = Typed(f"\\boxed{{{answer}}}")
    episodes = run_play(_play_args(env="visual", model=tiny_vl_dir, task=2, images_dir=tmp_path / "shown"),
                        Screen(typed))
    shown = capsys.readouterr().out
    saved = list((tmp_path / "shown" / "images").iterdir())
    assert len(saved) == 1 and f"[image 64 x 64 px, 4 tokens: {saved[0]}]" in shown
    assert "<|vision_start|>" in shown and "<|image_pad|>" not in shown  # the image stands in for its tokens
    assert "What colour is the largest shape?" in shown
    assert episodes[0].reward == 1.0 and "renderer qwen3_vl_instruct" in shown


def test_chat_attaches_an_image_with_slash_image(vl_tokenizer, tmp_path):
    from test_export_chat_play import Typed

    from polyrl.interactive import Screen, chat_loop

    Image.new("RGB", (64, 64), (255, 0, 0)).save(tmp_path / "red.png")
    renderer = vl_renderer(vl_tokenizer)
    sampler = ReplySampler(vl_tokenizer, ["red", "ok"])
    typed = Typed("/image /nonexistent.png", f"/image {tmp_path / 'red.png'}", "What colour?", "thanks")
    asyncio.run(chat_loop(sampler, renderer, Screen(typed), 1.0, 8))
    first, second = sampler.inputs
    assert [c.expected_tokens for c in first.chunks if c.type == "image"] == [4]
    assert [c.type for c in second.chunks].count("image") == 1  # the image is not sent twice
    # a text-only model answers an image with an error line, and the chat goes on
    sampler = ReplySampler(vl_tokenizer, ["hi"])
    typed = Typed(f"/image {tmp_path / 'red.png'}", "What colour?", "hello")
    asyncio.run(chat_loop(sampler, get_renderer("qwen3", vl_tokenizer), Screen(typed), 1.0, 8))
    assert len(sampler.inputs) == 1 and sampler.inputs[0].chunks[0].type == "encoded_text"
