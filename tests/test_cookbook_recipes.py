"""tinker-cookbook's own recipes, unmodified, against ``polyrl serve`` on 127.0.0.1 with a tiny model.

Each recipe runs as its users run it (``python -m tinker_cookbook.recipes...`` with chz arguments, the
official SDK underneath), sized down (a few steps, tiny batches, short ``max_tokens``), and each test reads
the recipe's own ``metrics.jsonl``.

Hub data sets are stood in by local files, without touching the recipes: ``datasets.load_dataset(name)``
takes a local directory of that name (relative to the working directory) before the hub, so a
``openai/gsm8k`` directory laid out like the hub's repository (a README whose ``configs:`` name the ``main``
configuration and its files) answers ``load_dataset("openai/gsm8k", "main")``, and an ``Anthropic/hh-rlhf``
directory with ``train.jsonl`` and ``test.jsonl`` answers ``load_dataset("Anthropic/hh-rlhf")``. ``rl_loop``
has no renderer option (it looks the model's name up in the cookbook's model table), so its model is a
directory named as its default model, ``Qwen/Qwen3.5-9B-Base``, in that same working directory, which
``polyrl serve`` (started there) serves under that name. ``sdft`` reads ToolAlpaca from a local Arrow
directory (its ``toolalpaca_data_path`` option).
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
from test_serve import Served, _cookbook

pytest.importorskip("tinker_cookbook")

RL_LOOP_MODEL = "Qwen/Qwen3.5-9B-Base"  # rl_loop's default model; the cookbook renders it with role_colon


def _rows(log: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (log / name).read_text().splitlines() if x.strip()]


def _finite(rows: list[dict], key: str) -> list[float]:
    values = [r[key] for r in rows if key in r]
    assert values and all(math.isfinite(v) for v in values), (key, values)
    return values


def _boxed_coin_flip_model(tiny_model_dir: str, out: Path) -> None:
    """The tiny model turned into a bigram model that answers every prompt with ``\\boxed{3}`` or
    ``\\boxed{7}`` (even odds), then ends: the attention and MLP outputs are zeroed (so the last hidden
    state is the current token's embedding) and the untied output layer maps each token to its successor.
    A random tiny model never writes ``\\boxed{}``, so rl_loop (which skips a batch whose rewards are all
    equal) would never train on it; this one is right about half the time, as a learner should be."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    chain = tok.encode("\\boxed{")
    three, seven, close = (tok.encode(c)[0] for c in "37}")
    successors = {t: [n] for t, n in itertools.pairwise(chain)} | {chain[-1]: [three, seven]}
    successors |= {three: [close], seven: [close], close: [tok.eos_token_id]}
    hidden = model.config.hidden_size
    assert len(successors) < hidden and len(set(chain)) == len(chain)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        embed = torch.zeros_like(model.get_input_embeddings().weight)
        head = torch.zeros_like(embed)
        embed[:, 0] = 1.0  # every other token: the start of the answer comes next
        head[chain[0], 0] = 10.0
        for k, (token, nexts) in enumerate(successors.items(), start=1):
            embed[token] = 0.0
            embed[token, k] = 1.0
            head[nexts, k] = 10.0
        model.get_input_embeddings().weight.copy_(embed)
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)


@pytest.fixture(scope="module")
def hub(tiny_model_dir, tmp_path_factory) -> Path:
    """The working directory of the recipes and the server: models and data sets under hub names."""
    root = tmp_path_factory.mktemp("cookbook-hub")
    _boxed_coin_flip_model(tiny_model_dir, root / RL_LOOP_MODEL)
    return root


@pytest.fixture(scope="module")
def served(hub, tiny_model_dir, tmp_path_factory):
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("cookbook-store"), "--models", tiny_model_dir,
               RL_LOOP_MODEL, "--long-poll", "1", cwd=hub)
    yield s
    s.stop()


def _gsm8k(hub: Path, n: int) -> None:
    """``openai/gsm8k`` (configuration ``main``) as the hub lays it out: the README's ``configs:`` block names
    the configuration's files. Answers end ``#### N`` as GSM8K's do; every one is 7, as the coin-flip model
    answers without reading the question (answers that differed would pull its one choice both ways)."""
    root = hub / "openai" / "gsm8k"
    (root / "main").mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n---\n")
    for split, count in (("train", n), ("test", 2)):
        rows = [{"question": f"Tom has {i} apples and finds {7 - i} more. How many apples has he now?",
                 "answer": f"{i} + {7 - i} = 7\n#### 7"} for i in range(count)]
        (root / "main" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_cookbook_rl_loop_recipe(served, hub, tmp_path):
    """rl_loop at its defaults (model name, loss stable_reinforce with its provenance spans, TTL'd state
    saves) but size, on a local GSM8K."""
    _gsm8k(hub, 8)
    done = _cookbook("tinker_cookbook.recipes.rl_loop", served, tmp_path, "batch_size=2", "group_size=4",
                     "max_tokens=8", "lora_rank=4", "max_steps=3", "save_every=2", cwd=hub, log_dir_arg=False)
    assert done.returncode == 0, done.stderr[-3000:]
    log = tmp_path / "log"
    rows = _rows(log)
    assert [r["step"] for r in rows] == [0, 1, 2]
    rewards = _finite(rows, "reward/total")
    assert all(0.0 <= r <= 1.0 for r in rewards) and 0.0 < sum(rewards) < len(rewards), rewards
    # a batch whose rewards all agree is skipped (no optim_step metrics: 1 in 64 here, as this model is right
    # half the time); the others trained with stable_reinforce on rl_loop's provenance spans
    grad_norms = _finite(rows, "grad_norm:mean")
    assert all(g > 1e-3 for g in grad_norms), grad_norms
    cps = _rows(log, "checkpoints.jsonl")
    assert [c["name"] for c in cps] == ["000002", "final"]
    assert cps[0]["state_path"].startswith("tinker://") and cps[-1]["sampler_path"].startswith("tinker://")


@pytest.mark.slow
def test_cookbook_async_math_rl_with_max_steps_off_policy(served, tiny_model_dir, tmp_path):
    """math_rl in async mode (``max_steps_off_policy=2``: sampling runs ahead of training on weights up to two
    steps old), at the async run's default loss, stable_reinforce."""
    args = [f"model_name={tiny_model_dir}", "renderer_name=qwen3", "env=arithmetic", "groups_per_batch=4",
            "group_size=2", "lora_rank=4", "eval_every=0", "save_every=2", "max_steps=3",
            "max_steps_off_policy=2"]
    done = _cookbook("tinker_cookbook.recipes.math_rl.train", served, tmp_path, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(tmp_path / "log")
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == [0, 1, 2]
    _finite(trained, "env/all/reward/total")
    assert len(_finite(trained, "grad_norm:mean")) == 3  # an optim_step each step
    assert len(_finite(trained, "optim/kl_sample_train_v1")) == 3
    assert all(r["tokens/trained"] > 0 for r in trained)
    staleness = [r["async/staleness_max"] for r in trained]
    assert all(0 <= s <= 2 for s in staleness), staleness  # how far sampling ran ahead: at most 2 steps
    cps = _rows(tmp_path / "log", "checkpoints.jsonl")
    assert cps[-1]["name"] == "final" and cps[-1]["state_path"].startswith("tinker://")


@pytest.mark.slow
def test_cookbook_sdft_recipe_at_topk_20(served, tiny_model_dir, tmp_path):
    """sdft at its default ``topk=20`` (the teacher's top-20 prompt logprobs as soft targets of
    cross_entropy) on a local ToolAlpaca in the Arrow layout its ``toolalpaca_data_path`` reads."""
    import datasets

    prompts = [f"Call the weather tool for city {i}." for i in range(8)]
    golden = [f'<tool_call>{{"name": "weather", "arguments": {{"city": {i}}}}}</tool_call>' for i in range(8)]
    data = tmp_path / "toolalpaca"
    datasets.Dataset.from_dict({"prompt": prompts, "golden_response": golden}).save_to_disk(data)
    done = _cookbook("tinker_cookbook.recipes.sdft.train", served, tmp_path, f"model_name={tiny_model_dir}",
                     "renderer_name=qwen3", "dataset=toolalpaca", f"toolalpaca_data_path={data}",
                     "groups_per_batch=2", "max_tokens=8", "lora_rank=4", "eval_every=0", "save_every=2",
                     "max_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(tmp_path / "log")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["sdft/topk"] == 20 and r["sdft/num_datums"] == 2 for r in rows)
    # the recipe logs no loss; its top-20 teacher distribution's entropy and the soft-target gradient it gave
    entropy = _finite(rows, "sdft/mean_teacher_entropy")
    assert all(0 < e <= math.log(20) for e in entropy), entropy
    grad_norms = _finite(rows, "grad_norm:mean")
    assert len(grad_norms) == 3 and all(g > 0 for g in grad_norms), grad_norms
    cps = _rows(tmp_path / "log", "checkpoints.jsonl")
    assert cps[-1]["name"] == "final" and cps[-1]["sampler_path"].startswith("tinker://")


def _hh_rlhf(root: Path) -> None:
    """``Anthropic/hh-rlhf`` as the hub lays it out (``train`` and ``test`` JSON lines of transcripts that
    differ in the last assistant turn)."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 8), ("test", 2)):
        rows = [{"chosen": f"\n\nHuman: What is {i} plus {i}?\n\nAssistant: It is {2 * i}.",
                 "rejected": f"\n\nHuman: What is {i} plus {i}?\n\nAssistant: No idea, ask someone else."}
                for i in range(n)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_cookbook_dpo_recipe(served, hub, tiny_model_dir, tmp_path):
    """preference/dpo at its default data set (hh-rlhf, stood in by local pairs) and settings but size."""
    _hh_rlhf(hub / "Anthropic" / "hh-rlhf")
    done = _cookbook("tinker_cookbook.recipes.preference.dpo.train", served, tmp_path,
                     f"model_name={tiny_model_dir}", "renderer_name=role_colon", "batch_size=4",
                     "max_length=256", "max_steps=3", cwd=hub)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(tmp_path / "log")
    assert [r["step"] for r in rows] == [0, 1]  # 8 pairs, 4 a batch, one epoch
    losses = _finite(rows, "dpo_loss")
    # at step 0 the policy is the reference (the server's base-model logprobs): -log sigmoid(0) exactly
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert losses[1] < losses[0], losses  # the first step raised the chosen answers over the rejected ones
    assert all(0 <= a <= 1 for a in _finite(rows, "accuracy")) and _finite(rows, "test/nll")
    cps = _rows(tmp_path / "log", "checkpoints.jsonl")
    assert [c["name"] for c in cps] == ["final"]
    assert cps[0]["state_path"].startswith("tinker://") and cps[0]["sampler_path"].startswith("tinker://")
