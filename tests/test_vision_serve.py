"""``polyrl serve`` with a vision-language model: images over HTTP from the official SDK (ImageChunks in
protobuf forward_backward bodies and JSON sampling bodies), the same numbers as in-process, and bounds on
images (each malformed or oversized one a clear 4xx, the server serving on)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from test_serve import KEY, PROTO, Served, _fwdbwd_body, _retrieve, _session
from test_stable_reinforce import sampled_datum
from test_vision import png_header
from tinker import types

from polyrl import images
from polyrl.local import ServiceClient

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def served(tiny_vl_dir, tmp_path_factory):
    s = Served(tiny_vl_dir, tmp_path_factory.mktemp("vl-serve-store"), "--long-poll", "1",
               "--max-body-mb", "2",
               "--max-request-images", "3", "--max-image-pixels", "250000", "--max-image-bytes", "400000")
    yield s
    s.stop()


def picture(colour, size=(64, 64)) -> bytes:
    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(colour, (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4))
    return images.encode(image)


def sequence(vl_tokenizer, colour, text: str, reply: str) -> tuple[list[int], list[images.ImageSpan]]:
    from polyrl.renderers import get_renderer

    renderer = get_renderer("qwen3_vl_instruct", vl_tokenizer)
    user = {"role": "user", "content": [{"type": "image", "image": picture(colour)},
                                        {"type": "text", "text": text}]}
    rendered, _ = renderer.render_supervised([user, {"role": "assistant", "content": reply}])
    return rendered.tokens, rendered.images


def datums(vl_tokenizer) -> list[types.Datum]:
    out = []
    for colour, reply in (((220, 30, 30), "red"), ((30, 70, 220), "blue"), ((220, 30, 30), "red!")):
        tokens, spans = sequence(vl_tokenizer, colour, "What colour?", reply)
        model_input, targets = images.next_token_inputs(tokens, spans)
        n = len(targets)
        out.append(types.Datum(model_input=model_input, loss_fn_inputs={
            "target_tokens": types.TensorData(data=targets, dtype="int64"),
            "logprobs": types.TensorData(data=[-3.0] * n, dtype="float32"),
            "advantages": types.TensorData(data=[0.0] * (n - 4) + [1.0, -0.5, 1.0, 0.5], dtype="float32")}))
    return out


def test_images_over_http_give_the_in_process_numbers(served, sdk, tiny_vl_dir, vl_tokenizer, tmp_path):
    """Through the official SDK (forward_backward: protobuf with ImageChunks; sample: JSON with base64
    images), the loss, logprobs and seeded samples are the in-process engine's; so is a stable_reinforce
    step on those samples (recorded with their pictures, named by provenance spans)."""
    data = datums(vl_tokenizer)
    local = ServiceClient(store_dir=tmp_path / "store")
    results = {}
    for name, service in (("served", sdk), ("local", local)):
        tc = service.create_lora_training_client(base_model=tiny_vl_dir, rank=4, seed=7).result()
        first = tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        second = tc.forward(data, "importance_sampling").result()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        prompt_tokens, spans = sequence(vl_tokenizer, (30, 70, 220), "What colour?", "x")
        end = spans[0].end + 9  # the prompt: up to the generation prompt
        prompt = images.model_input(prompt_tokens, spans, end)
        sample = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=11)).result()
        stable = [sampled_datum(prompt_tokens[:end], seq, advantage, spans=spans)
                  for seq, advantage in zip(sample.sequences, (1.0, -0.5, 2.0))]
        results[name] = (first, second, sample, tc.forward_backward(stable, "stable_reinforce").result())
    (f_s, s_s, sample_s, r_s), (f_l, s_l, sample_l, r_l) = results["served"], results["local"]
    assert r_s.metrics["sampled_tokens:sum"] == sum(len(seq.tokens) for seq in sample_s.sequences) > 0
    assert r_s.metrics["loss:sum"] == pytest.approx(r_l.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert f_s.metrics["loss:sum"] == pytest.approx(f_l.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert s_s.metrics["loss:sum"] == pytest.approx(s_l.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    for a, b in zip(s_s.loss_fn_outputs, s_l.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    assert [list(s.tokens) for s in sample_s.sequences] == [list(s.tokens) for s in sample_l.sequences]
    for a, b in zip(sample_s.sequences, sample_l.sequences):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def _sampling_session(served) -> str:
    http = served.http
    session = _session(served)
    r = http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                    "base_model": served.model_dir})
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def _sample_body(session: str, seq: int, chunk: dict) -> dict:
    return {"sampling_session_id": session, "seq_id": seq, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 342, 205]}, chunk,
                                  {"type": "encoded_text", "tokens": [2, 205]}]},
            "sampling_params": {"max_tokens": 2}}


def _image_chunk(data: bytes, fmt: str = "png", expected: int | None = 4) -> dict:
    out = {"type": "image", "data": base64.b64encode(data).decode(), "format": fmt}
    if expected is not None:
        out["expected_tokens"] = expected
    return out


BAD = [  # (what, chunk, status, words)
    ("1 GB PNG header", _image_chunk(png_header(16384, 16384, 6)), 413, "16,384 x 16,384 pixels"),
    ("50,000 x 50,000", _image_chunk(png_header(50_000, 50_000)), 413, "50,000 x 50,000 pixels"),
    ("0x0", _image_chunk(png_header(0, 0)), 400, "0 x 0 pixels"),
    ("truncated JPEG", _image_chunk(picture((1, 2, 3))[:150], "jpeg"), 400, "corrupt or truncated"),
    ("not an image", _image_chunk(b"hello world"), 400, "not an image in a known format"),
    ("no expected_tokens", _image_chunk(picture((1, 2, 3)), "jpeg", None), 400, "needs expected_tokens"),
    ("an asset pointer", {"type": "image_asset_pointer", "format": "png", "location": "/etc/passwd",
                          "expected_tokens": 4}, 400, "no asset store"),
]


def test_each_bad_image_is_one_clear_4xx_and_the_server_keeps_serving(served, vl_tokenizer):
    http = served.http
    session = _sampling_session(served)
    for seq, (what, chunk, status, words) in enumerate(BAD):
        r = http.post("/asample", json=_sample_body(session, seq, chunk))
        assert r.status_code == status, (what, r.status_code, r.text[:300])
        assert words in r.json()["error"] and r.json()["category"] == "user", (what, r.json())
    # past the bounds of a request: too many images, an image of too many bytes, a body past the limit
    body = _sample_body(session, 50, _image_chunk(picture((1, 2, 3)), "jpeg"))
    body["prompt"]["chunks"] = body["prompt"]["chunks"] * 4
    r = http.post("/asample", json=body)
    assert r.status_code == 400 and "takes at most 3 per request (--max-request-images)" in r.json()["error"]
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (400, 500, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    noisy.save(buffer, format="PNG")
    r = http.post("/asample", json=_sample_body(session, 51, _image_chunk(buffer.getvalue())))
    assert r.status_code == 413 and "more than max_image_bytes=400,000" in r.json()["error"], r.text[:300]
    # what only the model's processor knows comes back as the request's error (the SDK's user error)
    r = http.post("/asample", json=_sample_body(session, 52, _image_chunk(picture((1, 2, 3)), "jpeg", 9)))
    assert r.status_code == 200
    result = _retrieve(served, r.json()["request_id"])
    assert "expected_tokens=9 but the model's image processor makes 4 tokens" in result["error"]
    assert result["category"] == "user"
    # forward_backward's protobuf bodies: the same checks on the same images
    model = http.post("/create_model", json={"session_id": _session(served), "model_seq_id": 0,
                                             "base_model": served.model_dir, "lora_config": {"rank": 2}})
    model_id = _retrieve(served, model.json()["request_id"])["model_id"]
    for seq, (what, chunk, status, words) in enumerate(BAD[:5], start=1):
        datum = types.Datum(model_input=types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=[1, 342]),
            types.ImageChunk(data=base64.b64decode(chunk["data"]), format=chunk["format"], expected_tokens=4),
            types.EncodedTextChunk(tokens=[2])]),
            loss_fn_inputs={"target_tokens": types.TensorData(data=[0] * 7, dtype="int64")})
        r = http.post("/forward_backward", content=_fwdbwd_body(model_id, seq, [datum]), headers=PROTO)
        assert r.status_code == status and words in r.json()["error"], (what, r.status_code, r.text[:300])
    # and it still serves: a good image samples
    r = http.post("/asample", json=_sample_body(session, 60, _image_chunk(picture((1, 2, 3)), "jpeg")))
    assert len(_retrieve(served, r.json()["request_id"])["sequences"]) == 1
    assert served.alive()


# ---- tinker-cookbook's vlm_classifier recipe --------------------------------------------------------------
CLASSES = {"red_square": (220, 30, 30), "blue_disc": (30, 70, 220), "green.bar": (30, 160, 60)}


def hub_format_dataset(root) -> None:
    """A small image-classification data set where the recipe's
    ``load_dataset("dpdl-benchmark/caltech101")`` finds it (a directory of that name under the working
    directory), in the hub data set's format: parquet splits ``train`` and ``test`` with an ``image``
    column and a ``label`` ClassLabel."""
    import datasets

    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=list(CLASSES))})
    folder = root / "dpdl-benchmark" / "caltech101" / "data"
    folder.mkdir(parents=True)
    for split, count in (("train", 6), ("test", 2)):
        rows = {"image": [], "label": []}
        for label, colour in enumerate(CLASSES.values()):
            for k in range(count):
                rows["image"].append(Image.open(io.BytesIO(picture(colour, (48 + 8 * k, 48)))))
                rows["label"].append(label)
        parquet = folder / f"{split}-00000-of-00001.parquet"
        datasets.Dataset.from_dict(rows, features=features).to_parquet(parquet)


@pytest.mark.slow
def test_cookbook_vlm_classifier_recipe_trains_through_polyrl_serve(tiny_vl_dir, tmp_path):
    """tinker-cookbook's ``vlm_classifier`` training recipe, unmodified, against ``polyrl serve``: images
    go over HTTP in every forward_backward and in its NLL and sampling evaluators; the loss falls and every
    metric it logs is finite."""
    import json
    import os
    import subprocess
    import sys

    hub_format_dataset(tmp_path)
    served = Served(tiny_vl_dir, tmp_path / "store")
    try:
        env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1"}
        done = subprocess.run(
            [sys.executable, "-m", "tinker_cookbook.recipes.vlm_classifier.train", f"base_url={served.url}",
             f"experiment_dir={tmp_path / 'exp'}", f"model_name={tiny_vl_dir}",
             "renderer_name=qwen3_vl_instruct",
             "behavior_if_log_dir_exists=delete", "batch_size=6", "num_epochs=3", "lora_rank=4",
             "learning_rate=1e-2", "save_every=0", "eval_every=4", "n_eval=3", "max_tokens=12",
             "max_length=256"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert served.alive()
    finally:
        served.stop()
    (log,) = (tmp_path / "exp").iterdir()
    rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 9 and all(np.isfinite(nll)), nll
    assert nll[-1] < 0.5 * nll[0], nll
    evals = [r for r in rows if "test/nll" in r]
    assert evals and all(np.isfinite(r["test/nll"]) and "accuracy" in r for r in evals), evals
    assert evals[-1]["test/nll"] < evals[0]["test/nll"]
