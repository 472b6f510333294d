"""tinker-cookbook's recipes for rewards that no code computes, run unmodified against ``polyrl serve`` with
a tiny model (the model served under the recipes' own names where they hard-code one): an LLM grader
with rubrics, pairwise preferences as a reward, the three-stage RLHF pipeline (SFT, a preference model,
RL against it), tic-tac-toe self-play and twenty questions against an answerer model. Each test reads the
recipe's own metrics: they are the reference behaviour polyrl's own judges, preferences and self-play
(``tests/test_judge.py``, ``tests/test_env_textarena.py``) are held to. The rubric test also trains
``polyrl train`` on the recipe's own data file (the ``prompts`` environment reads its format).

The recipes and the server run in one working directory (``hub``) where hub names resolve to local
directories: the models the recipes name (``Qwen/Qwen3.5-9B-Base`` for rlhf, ``Qwen/Qwen3.5-4B`` and the
answerer ``Qwen/Qwen3.5-9B`` for twenty questions) are the tiny model copied under those names (rlhf's
with two more tokens, see ``_with_verdict_tokens``), which ``polyrl serve`` (started there with those
names) serves, and ``datasets.load_dataset`` takes the ``HuggingFaceH4/no_robots`` and
``Anthropic/hh-rlhf`` directories there, laid out as the hub lays them out, before the hub."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cookbook_recipes import _hh_rlhf
from test_serve import KEY, Served

from polyrl.config.schema import TrainConfig
from polyrl.tracking.console import ConsoleLog

pytestmark = pytest.mark.slow


RLHF_BASE = "Qwen/Qwen3.5-9B-Base"  # rlhf_pipeline's default base model; the cookbook renders it role_colon
TWENTY_QUESTIONS_PLAYER = "Qwen/Qwen3.5-4B"  # twenty_questions' default policy
TWENTY_QUESTIONS_ANSWERER = "Qwen/Qwen3.5-9B"  # its answerer, fixed in the recipe's data set builder


def _with_verdict_tokens(model_dir: str, out: Path) -> None:
    """The tiny model with `` A`` and `` B`` as single tokens, as Qwen's own tokenizers have them. rlhf's
    preference model gives its verdict as one sampled token after ``Assistant:`` and trains on the first
    token of ``" A"`` or ``" B"``; the tiny BPE spells those as a space and then the letter, so its
    preference model could only ever learn (and answer) a space. The two tokens are new BPE merges placed
    before the special tokens (which keep their embedding rows, moved two places up); their rows copy
    those of ``A`` and ``B``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(model_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    bpe = spec["model"]
    first = len(bpe["vocab"])  # the special tokens follow the BPE's own
    assert min(t["id"] for t in spec["added_tokens"] if t["id"] >= first) == first
    for t in spec["added_tokens"]:
        t["id"] += 2 if t["id"] >= first else 0
    for k, letter in enumerate("AB"):
        bpe["vocab"]["\u0120" + letter] = first + k
        bpe["merges"].append(["\u0120", letter])
    (out / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(out)
    assert [tok.decode([t]) for t in tok.encode("Assistant: A")][-1] == " A"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    old = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():
        rows = model.get_input_embeddings().weight
        rows[first + 2:] = old[first:]
        rows[first:first + 2] = old[tok.convert_tokens_to_ids(["A", "B"])]
    model.save_pretrained(out)


def _no_robots(root: Path) -> None:
    """``HuggingFaceH4/no_robots`` as the hub lays it out: one parquet file per split under ``data/``, rows
    of ``prompt``, ``prompt_id``, ``messages`` and ``category``."""
    import datasets

    (root / "data").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 8), ("test", 2)):
        rows = [{"prompt": f"Which number comes after {i}?", "prompt_id": f"{split}-{i}",
                 "messages": [{"role": "user", "content": f"Which number comes after {i}?"},
                              {"role": "assistant", "content": f"{i + 1} comes after {i}."}],
                 "category": "Open QA"} for i in range(n)]
        datasets.Dataset.from_list(rows).to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")


@pytest.fixture(scope="module")
def hub(tiny_model_dir, tmp_path_factory) -> Path:
    """The working directory of the recipes and the server: models and data sets under hub names."""
    root = tmp_path_factory.mktemp("cookbook-hub")
    _with_verdict_tokens(tiny_model_dir, root / RLHF_BASE)
    for name in (TWENTY_QUESTIONS_PLAYER, TWENTY_QUESTIONS_ANSWERER):
        shutil.copytree(tiny_model_dir, root / name)
    _no_robots(root / "HuggingFaceH4" / "no_robots")
    _hh_rlhf(root / "Anthropic" / "hh-rlhf")
    return root


@pytest.fixture(scope="module")
def served(hub, tiny_model_dir, tmp_path_factory):
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("serve-store"), "--models", tiny_model_dir, RLHF_BASE,
               TWENTY_QUESTIONS_PLAYER, TWENTY_QUESTIONS_ANSWERER, cwd=hub)
    yield s
    s.stop()


def run(module: str, served: Served, tmp_path: Path, *args: str,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` as its users run it against a Tinker service (``TINKER_BASE_URL``: the
    recipes that build their own clients read it) in ``cwd`` (default ``tmp_path``); a recipe that takes
    no log path writes under ``tmp_path / 'runs'`` (the cookbook's runs directory)."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_BASE_URL": served.url, "TINKER_TELEMETRY": "0",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets-cache"),
           "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path / "runs")}
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=cwd or tmp_path,
                          capture_output=True, text=True, timeout=600)


def rows_of(log: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (log / name).read_text().splitlines() if x.strip()]


def recipe(module: str, served: Served, tmp_path: Path, *args: str, cwd: Path | None = None) -> list[dict]:
    """The recipe run (``run``) logging to ``tmp_path / 'log'``; its metrics rows."""
    done = run(module, served, tmp_path, f"log_path={tmp_path / 'log'}", "behavior_if_log_dir_exists=delete",
               *args, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return rows_of(tmp_path / "log")


def test_the_rubric_recipe_grades_with_the_served_model_and_polyrl_trains_on_its_data(
        served, tiny_model_dir, tmp_path):
    from tinker_cookbook.recipes.rubric.generate_data import generate_dataset

    train_file, test_file = generate_dataset(num_train=8, num_test=2, seed=0, write_dir=str(tmp_path))
    rows = recipe("tinker_cookbook.recipes.rubric.train", served, tmp_path, f"base_url={served.url}",
                  f"model_name={tiny_model_dir}", "renderer_name=qwen3", f"grader_llm_name={tiny_model_dir}",
                  "grader_renderer_name=qwen3", f"train_jsonl_path={train_file}",
                  f"test_jsonl_path={test_file}",
                  "groups_per_batch=2", "train_group_size=2", "max_tokens=8", "lora_rank=4", "eval_every=0",
                  "save_every=0", "max_steps=2")
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == [0, 1]
    # a tiny grader writes no <score>: the recipe counts that as a score of 0 without saying so
    assert all(r["env/all/reward/total"] <= 0.0 for r in trained)

    # polyrl train on the recipe's own file: the same tasks and rubrics, graded by the same base model;
    # the unreadable verdicts are failures it counts, not zeros
    from polyrl.rl.train import train

    config = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=1, max_tokens=8,
                         save_every=0, eval_every=0, log_path=str(tmp_path / "polyrl"),
                         local={"store_dir": str(tmp_path / "store")}, outputs={"report": False},
                         environments={"rubric": {"type": "prompts", "num_rollouts": 2,
                                                  "splits": {"test": None}, "args": {"path": train_file},
                                                  "judge": {"max_tokens": 8}}})
    train(config, ConsoleLog(enabled=False))
    run = tmp_path / "polyrl"
    (row,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["judge/parse_failures"] == row["judge/calls"] + row["judge/cached"] == 4
    episode = json.loads((run / "trajectories" / "step_000000.jsonl").read_text().splitlines()[0])
    assert episode["judge"][0]["rubric"].startswith("Does the chatbot correctly get the answer")
    assert [m["role"] for m in episode["messages"]][:3] == ["user", "assistant", "user"]  # the recipe's convo


def test_the_shorter_preference_recipe(served, tiny_model_dir, tmp_path):
    rows = recipe("tinker_cookbook.recipes.preference.shorter.train", served, tmp_path,
                  f"model_name={tiny_model_dir}", "renderer_name=qwen3", "batch_size=2", "group_size=4",
                  "max_tokens=8", "eval_every=0", "max_steps=2")
    trained = [r for r in rows if any(k.startswith("env/") for k in r)]
    assert [r["step"] for r in trained] == [0, 1]
    rewards = [v for r in trained for k, v in r.items() if k.startswith("env/all/reward")]
    assert rewards and all(-1.0 <= v <= 1.0 for v in rewards)  # win rates of pairwise comparisons


def test_the_text_arena_self_play_recipe(served, tiny_model_dir, tmp_path):
    rows = recipe("tinker_cookbook.recipes.multiplayer_rl.text_arena.train", served, tmp_path,
                  f"model_name={tiny_model_dir}", "renderer_name=qwen3", "game_name=TicTacToe-v0",
                  "batch_size=2", "num_train_datapoints=4", "num_test_datapoints=2", "max_tokens=8",
                  "eval_every=0", "save_every=0", "max_steps=2")
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == [0, 1]
    assert all(-1.0 <= r["env/all/reward/total"] <= 1.0 for r in trained)


def _groups(logtree: Path) -> list[dict]:
    """What the preference RL logged of each group it scored (``compute_group_rewards``): ``convos`` (the
    prompt, then each completion, as messages) and ``matchups`` ((i, j, the preference model's verdict on
    completion i against j: -1 for i, 1 for j, 0 for a tie or no verdict))."""
    groups: list[dict] = []
    matchup = re.compile(r"Matchup \d+: \((\d+) vs (\d+)\) — Reward: (\S+)")

    def walk(node, group):
        if isinstance(node, str):
            if group is not None and (m := matchup.fullmatch(node)):
                group["matchups"].append((int(m[1]), int(m[2]), float(m[3])))
            return
        children = node.get("children", [])
        if any(isinstance(c, dict) and c.get("tag") == "h3" and c["children"] == ["compute_group_rewards"]
               for c in children):
            group = {"convos": [], "matchups": []}
            groups.append(group)
        if group is not None and node.get("data", {}).get("type") == "conversation":
            group["convos"].append(node["data"]["messages"])
        for c in children:
            walk(c, group)

    walk(json.loads(logtree.read_text())["root"], None)
    return groups


def test_the_rlhf_pipeline_sft_then_a_preference_model_then_rl_against_it(served, hub, tmp_path):
    """rlhf_pipeline's three stages at its defaults (base model, data sets, renderer) but size: SFT on
    no_robots, a preference model trained on hh-rlhf comparisons, then RL from the SFT checkpoint with
    the preference model's verdicts as rewards. Its learning rate for the preference model is raised so
    that four steps teach it to answer with a verdict, which the RL stage's matchups then show."""
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.preference.types import Comparison, PreferenceModelFromChatRenderer
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    batch, group_size, steps = 2, 4, 4
    done = run("tinker_cookbook.recipes.preference.rlhf.rlhf_pipeline", served, tmp_path, "lora_rank=4",
               "max_length=256", f"batch_size={batch}", f"rl_group_size={group_size}", f"max_steps={steps}",
               "rl_max_tokens=8", "rm_learning_rate=0.05", "save_every=0", f"eval_every={steps}", cwd=hub)
    assert done.returncode == 0, done.stderr[-3000:]
    root = tmp_path / "runs" / "rlhf-qwen3_5_9b_base"
    sft, rm, rl = (rows_of(root / stage) for stage in ("sft", "rm", "rl"))
    sft_cp, rm_cp = (rows_of(root / stage, "checkpoints.jsonl")[-1] for stage in ("sft", "rm"))

    # the two supervised stages: max_steps of batches each, evaluated (test/nll) at step 0, a final checkpoint
    for rows, cp in ((sft, sft_cp), (rm, rm_cp)):
        assert [r["step"] for r in rows] == list(range(steps))
        assert all(r["num_sequences"] == batch and math.isfinite(r["train_mean_nll"]) for r in rows)
        assert math.isfinite(rows[0]["test/nll"])
        assert cp["name"] == "final" and cp["state_path"].startswith("tinker://")
    # the preference model trains on one token per comparison, its verdict, and learns it
    assert all(r["num_loss_tokens"] == batch for r in rm)
    assert rm[-1]["train_mean_nll"] < rm[0]["train_mean_nll"] - 1.0, [r["train_mean_nll"] for r in rm]

    # RL starts from the SFT stage's checkpoint (weights only) ...
    assert f"Loaded weights from {sft_cp['state_path']}" in done.stderr
    trained = [r for r in rl if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    for r in trained:
        assert r["env/all/total_episodes"] == batch * group_size
        assert -1.0 <= r["env/all/win_minus_loss"] <= 1.0 and 0.0 <= r["env/all/format"] <= 1.0
        # the recipe's reward: wins minus losses, less 1 for a completion that did not end with a stop
        wins, stops = r["env/all/win_minus_loss"], r["env/all/format"]
        assert r["env/all/reward/total"] == pytest.approx(wins + stops - 1)
    win_rates = [(r["step"], r["win_rate"]) for r in rl if "win_rate" in r]  # the test comparisons' evaluator
    assert [s for s, _ in win_rates] == [0, steps] and all(0.0 <= w <= 1.0 for _, w in win_rates)
    assert rows_of(root / "rl", "checkpoints.jsonl")[-1]["sampler_path"].startswith("tinker://")

    # ... and scores its matchups with the preference model's weights: every logged verdict is one; the
    # preference model's sampler gives the same verdicts on the same comparisons, the base model none
    groups = _groups(root / "rl" / "iteration_000000" / "train_logtree.json")
    assert len(groups) == batch
    comparisons, verdicts = [], []
    for g in groups:
        prompt, *completions = g["convos"]
        assert len(completions) == group_size and len(g["matchups"]) == group_size * (group_size - 1)
        for i, j, verdict in g["matchups"]:
            comparisons.append(Comparison(prompt, completions[i], completions[j]))
            verdicts.append(verdict)
    assert set(verdicts) <= {-1.0, 1.0}, verdicts
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(RLHF_BASE),
                                      get_tokenizer(str(hub / RLHF_BASE)))
    service = served.sdk()

    async def judge(sampling_client) -> list[float]:
        model = PreferenceModelFromChatRenderer(renderer, sampling_client)
        return list(await asyncio.gather(*(model(c) for c in comparisons)))

    rm_sampler = service.create_sampling_client(model_path=rm_cp["sampler_path"]).result()
    assert asyncio.run(judge(rm_sampler)) == verdicts
    base_sampler = service.create_sampling_client(base_model=RLHF_BASE).result()
    assert asyncio.run(judge(base_sampler)) == [0.0] * len(verdicts)


def test_the_twenty_questions_recipe_against_its_answerer_model(served, hub, tmp_path):
    """twenty_questions at its defaults (player model and renderer, answerer model, secret words) but size:
    the answerer, sampled by the recipe under its fixed name, answers each of the player's questions."""
    from tinker_cookbook.recipes.multiplayer_rl.twenty_questions import env as twenty_questions

    batch, group_size = 1, 2
    rows = recipe("tinker_cookbook.recipes.multiplayer_rl.twenty_questions.train", served, tmp_path,
                  f"batch_size={batch}", f"group_size={group_size}", "max_tokens=8", "eval_every=0",
                  "save_every=0", "max_steps=2", cwd=hub)
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == [0, 1]
    for r in trained:
        assert r["env/all/total_episodes"] == batch * group_size
        assert 0.0 <= r["env/all/reward/total"] <= 1.0  # 1 for naming the secret word, else 0
        assert 1.0 <= r["env/all/turns_per_episode"] <= 20.0 and r["env/all/ac_tokens_per_turn"] <= 8

    words = set(twenty_questions._load_words_from_file())
    for step in (0, 1):
        it = tmp_path / "log" / f"iteration_{step:06d}"
        episodes = rows_of(it, "train_rollout_summaries.jsonl")
        assert len(episodes) == batch * group_size
        for e in episodes:
            rewards = [s["reward"] for s in e["steps"]]
            # a game ends at the first right guess or after the 20th question, and only then
            assert len(rewards) == 20 or rewards[-1] == 1.0, rewards
            assert set(rewards[:-1]) <= {0.0} and rewards[-1] in (0.0, 1.0)
            assert [s["episode_done"] for s in e["steps"]] == [False] * (len(rewards) - 1) + [True]
            # each turn's observation holds the one before, the question and the answerer's reply
            obs = [s["ob_len"] for s in e["steps"]]
            assert all(b > a + s["ac_len"] for a, b, s in zip(obs, obs[1:], e["steps"], strict=False))
        # the logged games: one answer per question, about the recipe's own secret words
        text = (it / "train_logtree.json").read_text()
        answers = re.findall(r"Turn (\d+) - Answerer: ", text)
        assert len(answers) == sum(len(e["steps"]) for e in episodes)
        secrets = re.findall(r"Game Over - Secret: (\w+)", text)
        assert len(secrets) == batch * group_size and set(secrets) <= words
        assert len(set(secrets)) == batch  # the games of a group are about one word
