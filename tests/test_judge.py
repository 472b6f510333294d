"""LLM-judge rewards (``environments.<name>.judge``): verdicts read or refused, calls bounded and cached,
rewards that rise under a deterministic judge, unreadable verdicts counted, the judge's prompt and verdict
kept with the trajectory. Judges here are real: the rule judge of ``examples/judge`` behind real HTTP on
127.0.0.1 (an OpenAI-compatible endpoint), and the policy's own base model on the local engine."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tinker import types

from polyrl.config.env import JudgeConfig
from polyrl.config.schema import TrainConfig
from polyrl.rl.chat_models import EndpointChat
from polyrl.rl.episode import Episode, RolloutSettings
from polyrl.rl.judge import Judge, JudgeError, judge_metrics, read_score, transcript
from polyrl.tracking.console import ConsoleLog

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "judge"
SETTINGS = RolloutSettings(max_turns=1, max_tokens=8, temperature=1.0, timeout=60)
RUBRIC = "Use the letter 'e' as much as you can."


def test_the_verdicts_last_score_in_range_counts_and_anything_else_is_refused():
    assert read_score("first <score>2</score>, on reflection <SCORE> 7.5 </score>", (0, 10)) == (7.5, 0.75)
    assert read_score("<score>1</score>", (1, 5)) == (1.0, 0.0)
    with pytest.raises(JudgeError, match="no <score>NUMBER</score>"):
        read_score("I would give it a 7", (0, 10))
    with pytest.raises(JudgeError, match="outside"):
        read_score("<score>11</score>", (0, 10))
    context, answer = transcript([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}])
    assert context == "System: Be brief.\n\nUser: Hi" and answer == "Hello"


def test_judge_config_errors_are_one_line():
    base = {"model_name": "m", "environments": {"e": {"type": "prompts", "args": {"path": "x"}}}}
    for judge, problem in [({"base_url": "http://127.0.0.1:1/v1"}, "base_url needs model"),
                           ({"model": "m", "base_url": "ftp://x"}, "http:// or https://"),
                           ({"scale": [5, 1]}, "low < high"), ({"template": "grade {answer}"}, "{rubric}")]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            JudgeConfig(**judge)
    from polyrl.config.files import load_config

    with pytest.raises(Exception, match="no tasks|cannot read"):  # the prompts file is read at load
        load_config(None, ["environments.e.judge.rubrics=[x]"], base=base)


class Recorder(BaseHTTPRequestHandler):
    """The rule judge's grading (examples/judge/rule_judge.py), recording what each request carried."""

    seen: list[dict] = []
    hold = threading.Event()  # set: answer; clear: keep the request waiting (a judge that hangs)

    def do_POST(self):  # noqa: N802
        from rule_judge import grade

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.seen.append({"auth": self.headers.get("Authorization"), "body": body})
        Recorder.hold.wait(30)
        prompt = body["messages"][-1]["content"]
        verdict = "A fine reply." if "never say a score" in prompt else grade(prompt)
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": verdict}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        return None


@pytest.fixture
def endpoint(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    Recorder.seen, Recorder.hold = [], threading.Event()
    Recorder.hold.set()
    ThreadingHTTPServer.request_queue_size = 256
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    Recorder.hold.set()
    server.shutdown()


def _episode(reply: str) -> Episode:
    ep = Episode("letters", "train", 0, 0, messages=[{"role": "user", "content": "Say a word."},
                                                      {"role": "assistant", "content": reply}])
    ep.turn_rewards, ep.reward = [0.0], 0.0
    return ep


def test_an_endpoint_judge_grades_caches_identical_answers_and_sends_the_key(endpoint, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-secret")
    cfg = JudgeConfig(model="rule", base_url=endpoint, api_key_env="MY_JUDGE_KEY", scale=(0, 10), weight=2.0,
                      rubrics=[RUBRIC])
    judge = Judge(cfg, EndpointChat(cfg), SETTINGS)
    episodes = [_episode("eee"), _episode("eee"), _episode("tree"), _episode("xyz"), _episode("eee")]

    async def grade():
        await judge.grade_group(episodes, lambda ep: cfg.rubrics)
        await judge.aclose()

    asyncio.run(grade())
    assert [ep.metrics["judge/score"] for ep in episodes] == [1.0, 1.0, 0.5, 0.0, 1.0]
    assert [ep.reward for ep in episodes] == [2.0, 2.0, 1.0, 0.0, 2.0]  # weight 2
    assert [ep.success for ep in episodes] == [True, True, True, False, True]  # reward >= 1
    assert len(Recorder.seen) == 3 and {s["auth"] for s in Recorder.seen} == {"Bearer sk-secret"}
    assert Recorder.seen[0]["body"]["model"] == "rule" and Recorder.seen[0]["body"]["temperature"] == 0.0
    assert judge_metrics(episodes) == {"judge/calls": 3.0, "judge/cached": 2.0,
                                       "judge/seconds": pytest.approx(sum(r["seconds"] for ep in episodes
                                                                          for r in ep.judge)),
                                       "judge/parse_failures": 0.0, "judge/call_failures": 0.0}
    record = episodes[2].judge[0]
    assert record["rubric"] == RUBRIC and "<reply>\ntree\n</reply>" in record["prompt"]
    assert record["verdict"].endswith("<score>5.0</score>") and record["raw_score"] == 5.0


def test_an_unreadable_verdict_or_a_hung_judge_fails_the_episode_counted(endpoint):
    template = "Grade {answer} by {rubric}, but never say a score."  # the judge answers without one
    cfg = JudgeConfig(model="rule", base_url=endpoint, template=template, scale=(0, 10), rubrics=[RUBRIC])
    judge = Judge(cfg, EndpointChat(cfg), SETTINGS)
    unreadable = _episode("eee")
    asyncio.run(judge.grade_group([unreadable], lambda ep: cfg.rubrics))
    assert unreadable.error == "JudgeError: the verdict has no <score>NUMBER</score>: 'A fine reply.'"
    assert unreadable.reward == 0.0 and "judge/score" not in unreadable.metrics  # not a silent zero
    cfg = JudgeConfig(model="rule", base_url=endpoint, scale=(1, 5), rubrics=[RUBRIC])
    judge = Judge(cfg, EndpointChat(cfg), SETTINGS)
    out_of_range = _episode("xyz")
    asyncio.run(judge.grade_group([out_of_range], lambda ep: cfg.rubrics))
    assert "outside [1, 5]" in out_of_range.error and out_of_range.judge[0]["failure"] == "parse"
    assert judge_metrics([out_of_range])["judge/parse_failures"] == 1.0

    Recorder.hold.clear()  # the judge never answers: the call times out, the episode fails
    cfg = JudgeConfig(model="rule", base_url=endpoint, timeout=0.5, rubrics=[RUBRIC])
    judge = Judge(cfg, EndpointChat(cfg), SETTINGS)
    hung, no_rubric = _episode("eee"), _episode("eee")
    asyncio.run(judge.grade(hung, cfg.rubrics))
    assert "took over 0.5s" in hung.error and judge_metrics([hung])["judge/call_failures"] == 1.0
    asyncio.run(judge.grade(no_rubric, []))
    assert "no rubric" in no_rubric.error


def test_a_pairwise_judge_scores_each_reply_by_its_win_rate_in_both_orders(endpoint):
    cfg = JudgeConfig(model="rule", base_url=endpoint, mode="pairwise", rubrics=[RUBRIC])
    judge = Judge(cfg, EndpointChat(cfg), SETTINGS)
    episodes = [_episode("eee"), _episode("tree"), _episode("xyz"), _episode("xyz")]
    episodes[3].error = "RuntimeError: an environment's failure"  # not compared
    asyncio.run(judge.grade_group(episodes, lambda ep: cfg.rubrics))
    # eee beats both others in both orders; tree beats xyz; xyz beats no one
    assert [ep.metrics.get("judge/score") for ep in episodes] == [1.0, 0.5, 0.0, None]
    assert episodes[3].judge == [] and episodes[3].error.startswith("RuntimeError")
    assert len(episodes[0].judge) == 4 and {tuple(r["pair"]) for r in episodes[0].judge} == {
        (0, 1), (1, 0), (0, 2), (2, 0)}
    assert judge_metrics(episodes)["judge/calls"] == 6.0  # 3 replies: 6 ordered pairs, each one call
    ties = [_episode("bee"), _episode("bee")]
    asyncio.run(judge.grade_group(ties, lambda ep: cfg.rubrics))
    assert [ep.metrics["judge/score"] for ep in ties] == [0.5, 0.5]
    assert judge_metrics(ties) == pytest.approx({"judge/calls": 1.0, "judge/cached": 1.0,
                                                 "judge/seconds": judge_metrics(ties)["judge/seconds"],
                                                 "judge/parse_failures": 0.0, "judge/call_failures": 0.0})
    alone = [_episode("eee")]
    asyncio.run(judge.grade_group(alone, lambda ep: cfg.rubrics))
    assert alone[0].error == "JudgeError: a pairwise judge needs 2 replies"


def _train_config(model_dir: str, tmp_path: Path, judge: dict, **over) -> TrainConfig:
    data = dict(model_name=model_dir, lora_rank=8, batch_size=4, max_steps=6, max_tokens=6, save_every=0,
                learning_rate=3e-2, log_path=str(tmp_path / "run"), seed=0, eval_every=0,
                local={"store_dir": str(tmp_path / "store")}, outputs={"report": False},
                environments={"letters": {"type": "prompts", "num_rollouts": 8, "max_failing_rollouts": 8,
                                          "args": {"path": str(EXAMPLE / "tasks.jsonl")},
                                          "splits": {"test": None}, "judge": judge}})
    data.update(over)
    return TrainConfig(**data)


def _first_episode(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "trajectories" / "step_000000.jsonl").read_text().splitlines()[0])


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def rule_judge():
    """examples/judge/rule_judge.py, started as its docstring says (on a port of its choosing)."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLE / "rule_judge.py"), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        yield re.search(r"running on (\S+)", proc.stderr.readline()).group(1) + "/v1"
    finally:
        proc.terminate()
        proc.wait(30)


def _e_share(episodes: list[dict]) -> float:
    from rule_judge import share

    return sum(share(ep["messages"][-1]["content"], RUBRIC) for ep in episodes) / len(episodes)


def test_train_on_a_rule_judges_reward_raises_it(tiny_model_dir, tmp_path, rule_judge):
    """The rule judge makes the reward learnable (the share of 'e's in the reply): it rises over a short
    run, every episode graded over real HTTP, each trajectory row holding its prompt and verdict."""
    from polyrl.rl.train import train

    config = _train_config(tiny_model_dir, tmp_path, {"model": "rule", "base_url": rule_judge,
                                                      "scale": [0, 10]}, max_steps=12)
    train(config, ConsoleLog(enabled=False))
    rows = _rows(tmp_path)
    scores = [r["env/letters/judge/score"] for r in rows]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.3, scores
    assert all(r["rollouts/failed"] == 0 and r["judge/parse_failures"] == 0 for r in rows)
    assert all(r["judge/calls"] + r["judge/cached"] == 32 for r in rows)  # 4 groups x 8, one item each
    assert sum(r["judge/cached"] for r in rows) > 0  # as replies converge, equal ones are judged once
    episode = _first_episode(tmp_path)
    assert episode["judge"][0]["rubric"].startswith("Use the letter 'e'")
    assert episode["reward"] == pytest.approx(episode["judge"][0]["score"])  # the environment's own is 0

    # the report shows the judge's verdict beside the episode, in a real browser
    from test_report import _browser, _ensure_chromium, _open_episode, _wait

    from polyrl.report.build import build_report

    build_report(tmp_path / "run")
    _ensure_chromium()
    with _browser() as driver:
        driver.get((tmp_path / "run" / "report" / "index.html").as_uri())
        _wait(driver, "return document.body.dataset.ready === 'charts'")
        _open_episode(driver, 0, "letters")
        shown = _wait(driver, "const j = document.querySelector('#episode .judge'); return j && j.innerText")
        head = driver.find_element("css selector", "#episode .judge .msg-head").text.lower()
        title = driver.find_element("css selector", "#episode h3").text
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    rows = (tmp_path / "run" / "trajectories" / "step_000000.jsonl").read_text().splitlines()
    shown_row = json.loads(rows[int(title.rsplit("episode ", 1)[1])])["judge"][0]
    assert shown_row["verdict"] in shown and "Use the letter 'e'" in shown
    assert head.startswith("rubric 1") and f"({shown_row['raw_score']:g} given)" in head, head
    assert not errors, errors


def test_train_on_pairwise_preferences_makes_the_replies_better(tiny_model_dir, tmp_path, rule_judge,
                                                               monkeypatch):
    """The shorter-style pattern: the rule judge prefers, of two replies, the one with more 'e's; each
    reply's reward is its win rate in the group (so the mean reward stays 0.5) and the replies themselves
    get better: their share of 'e's rises."""
    from polyrl.rl.train import train

    monkeypatch.syspath_prepend(str(EXAMPLE))
    config = _train_config(tiny_model_dir, tmp_path, {"model": "rule", "base_url": rule_judge,
                                                      "mode": "pairwise"}, max_steps=16)
    train(config, ConsoleLog(enabled=False))
    rows = _rows(tmp_path)
    assert all(r["env/letters/judge/score"] == pytest.approx(0.5) for r in rows)  # win rates: zero-sum
    assert all(r["rollouts/failed"] == 0 for r in rows)
    steps = [[json.loads(line) for line in (tmp_path / "run" / "trajectories" / f"step_{k:06d}.jsonl")
              .read_text().splitlines()] for k in range(16)]
    first, last = _e_share(steps[0] + steps[1] + steps[2]), _e_share(steps[-3] + steps[-2] + steps[-1])
    assert last > first + 0.25, (first, last)
    assert len(steps[0][0]["judge"]) == 2 * 7  # compared with the 7 others, in both orders


def test_the_policys_base_model_judges_on_the_same_engine_and_unreadable_verdicts_are_reported(
        tiny_model_dir, tmp_path):
    """``judge: {}``: the judge is the policy's base model on the run's engine (one copy of the weights).
    A tiny model writes no <score>: every verdict is unreadable, counted, and the step says so."""
    from polyrl.rl import run as run_lib
    from polyrl.rl.train import train

    opened = []
    real_open = run_lib.open_judge

    async def recording_open(*args, **kwargs):
        judge = await real_open(*args, **kwargs)
        opened.append(judge)
        return judge

    run_lib.open_judge = recording_open
    try:
        config = _train_config(tiny_model_dir, tmp_path, {"max_tokens": 6}, max_steps=1, batch_size=2)
        train(config, ConsoleLog(enabled=False))
    finally:
        run_lib.open_judge = real_open
    sampler = opened[0].model.sampler
    assert sampler.get_base_model() == tiny_model_dir
    assert len(sampler._engine._bases) == 1  # the policy's base weights, not a second copy
    (row,) = _rows(tmp_path)
    assert row["judge/parse_failures"] == row["judge/calls"] + row["judge/cached"] == 16
    assert row["rollouts/failed"] == 16 and row["optim/datums"] == 0
    episode = _first_episode(tmp_path)
    assert episode["error"].startswith("JudgeError: the verdict has no <score>NUMBER</score>")
    assert episode["judge"][0]["verdict"] is not None and episode["judge"][0]["failure"] == "parse"


def test_a_judge_the_service_cannot_open_is_one_line(tiny_model_dir, tmp_path):
    from polyrl.errors import UserInputError
    from polyrl.rl.train import train

    config = _train_config(tiny_model_dir, tmp_path, {"model": "tinker://nope/sampler_weights/x"})
    with pytest.raises(UserInputError, match=r"environments\.letters\.judge"):
        train(config, ConsoleLog(enabled=False))



def test_a_yes_no_judge_reads_its_answer_from_the_logprobs(tiny_model_dir):
    """``mode: yes_no``: no verdict is written, so none is unreadable; the score is P(Yes) over P(Yes) +
    P(No) after the rubric's question, as the same sampler's compute_logprobs gives them."""
    import math

    from polyrl.local import ServiceClient
    from polyrl.renderers import get_renderer
    from polyrl.rl.chat_models import ServiceChat
    from polyrl.rl.judge import YES_NO_TEMPLATE, scored_tokens, yes_token

    service = ServiceClient()
    sampler = service.create_sampling_client(base_model=tiny_model_dir)
    renderer = get_renderer("chatml", sampler.get_tokenizer())
    cfg = JudgeConfig(mode="yes_no", rubrics=[RUBRIC])
    judge = Judge(cfg, ServiceChat(sampler, renderer, cfg, "the base model"), SETTINGS)
    episode = _episode("eee")
    asyncio.run(judge.grade_group([episode], lambda ep: cfg.rubrics))
    assert not episode.failed and judge_metrics([episode])["judge/parse_failures"] == 0.0
    question = YES_NO_TEMPLATE.replace("{rubric}", RUBRIC)
    tokens, _ = scored_tokens(renderer, episode.messages, [], question, yes_token(renderer.tokenizer))
    no = renderer.tokenizer.encode("No", add_special_tokens=False)[0]
    p_yes, p_no = (math.exp(sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()[-1])
                   for seq in (tokens, [*tokens[:-1], no]))
    assert episode.metrics["judge/score"] == pytest.approx(p_yes / (p_yes + p_no), rel=1e-4)
    assert episode.judge[0]["prompt"] == question and episode.reward == episode.metrics["judge/score"]
    with pytest.raises(ValueError, match="on the run's service"):
        JudgeConfig(mode="yes_no", model="m", base_url="http://127.0.0.1:1/v1")
