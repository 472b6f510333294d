"""textarena adapter (``textarena:<env_id>``) with the real textarena package, offline."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from polyrl.config.files import load_config
from polyrl.config.schema import ConfigError, TrainConfig
from polyrl.envs.registry import make_env_builder
from polyrl.envs.textarena_env import offered_moves


def _rng_state():
    return random.getstate(), np.random.get_state()[1].tobytes()


async def _play(builder, split, index, moves):
    env = builder.make(split, index)
    obs = await env.reset()
    results = []
    for move in moves:
        result = await env.step({"role": "assistant", "content": move})
        results.append(result)
        if result.done:
            break
    return obs, results


def test_single_player_game_multi_turn_reward_from_close():
    builder = make_env_builder("textarena:GuessTheNumber-v0", {}, seed=0)
    assert builder.spec.num_players == 1 and builder.spec.opponent is None
    random.seed(7)
    before = _rng_state()
    obs, results = asyncio.run(_play(builder, "train", 0, [f"[{n}]" for n in range(1, 21)]))
    assert _rng_state() == before  # textarena re-seeds `random`, but only the episode's private copy
    assert "Guess The Number" in obs.messages[0]["content"] and obs.messages[0]["role"] == "user"
    *middle, last = results
    assert all(not r.done and r.reward == 0.0 and r.messages[0]["role"] == "user" for r in middle)
    assert "[GAME] The target number is" in middle[0].messages[0]["content"]
    assert "[Player]" not in middle[0].messages[0]["content"]  # the policy's own move is not echoed back
    assert last.done and 0.0 <= last.reward <= 1.0 and last.metrics["reward_invalid"] == 0.0
    # same task, same game: deterministic; test tasks use other seeds
    assert [r.messages
            for r in asyncio.run(_play(builder, "train", 0, [f"[{n}]" for n in range(1, 21)]))[1]] == \
        [r.messages for r in results]
    assert builder.task_seed("train", 0) % 2 == 0 and builder.task_seed("test", 0) % 2 == 1


def test_two_player_game_against_scripted_opponents():
    builder = make_env_builder("textarena:TicTacToe-v0", {"opponent": "first", "player_id": "alternate"},
                               seed=0)
    assert builder.spec.num_players == 2
    # seat 0: the policy moves first; the opponent (always the first offered move) answers
    obs, results = asyncio.run(_play(builder, "train", 0, ["[4]", "[8]", "[6]", "[2]", "[5]"]))
    assert "Available Moves" in obs.messages[0]["content"]
    assert "[Player 1] [0]" in results[0].messages[0]["content"]  # the opponent's reply is observed
    assert results[-1].done and results[-1].reward in (-1.0, 0.0, 1.0)
    assert results[-1].metrics["opponent_moves"] >= 1
    # seat 1 (odd task index): the opponent has already moved when the policy first sees the board
    obs1, _ = asyncio.run(_play(builder, "train", 1, []))
    assert "[Player 0] [0]" in obs1.messages[0]["content"]
    # a fixed sequence of actions as opponent, and a win for the policy
    fixed = make_env_builder("textarena:TicTacToe-v0", {"opponent": {"actions": ["[0]", "[1]", "[3]"]}},
                             seed=0)
    _, results = asyncio.run(_play(fixed, "train", 0, ["[4]", "[8]", "[2]", "[6]"]))
    assert results[-1].done and results[-1].reward == 1.0 and results[-1].metrics["success"] == 1.0
    # an invalid move loses (textarena ends two-player games on invalid moves after its allowance)
    _, results = asyncio.run(_play(fixed, "train", 0, ["[4]", "[4]", "[4]", "[4]"]))
    assert results[-1].done and results[-1].reward == -1.0 and results[-1].metrics["invalid_move"] == 1.0


def test_callable_and_random_opponents():
    builder = make_env_builder("textarena:TicTacToe-v0",
                               {"opponent": "tests.test_env_textarena:center_then_first"}, seed=0)
    _, results = asyncio.run(_play(builder, "train", 0, ["[0]"]))
    assert "[Player 1] [4]" in results[0].messages[0]["content"]
    rand = make_env_builder("textarena:TicTacToe-v0", {"opponent": "random"}, seed=0)
    replies = set()
    for i in range(8):
        text = asyncio.run(_play(rand, "train", i, ["[4]"]))[1][0].messages[0]["content"]
        replies |= {line for line in text.splitlines() if line.startswith("[Player 1]")}
    assert len(replies) > 1  # the random opponent is seeded per task
    assert offered_moves("Board\nAvailable Moves: '[6]', '[7]'") == ["[6]", "[7]"]
    assert offered_moves("Your available actions are: '[check]', '[bet]'") == ["[check]", "[bet]"]


def center_then_first(observation: str) -> str:
    moves = offered_moves(observation)
    return "[4]" if "[4]" in moves else moves[0]


def test_string_rewards_are_not_numbers():
    # textarena's Countdown-v0 passes its arguments in the wrong order on invalid moves: the reward is a
    # string
    builder = make_env_builder("textarena:Countdown-v0", {}, seed=0)
    _, results = asyncio.run(_play(builder, "train", 0, ["nonsense", "nonsense"]))
    assert results[-1].done and results[-1].reward == 0.0 and results[-1].metrics["reward_invalid"] == 1.0


def _load(env: dict) -> TrainConfig:
    return load_config(None, [], base={"model_name": "m", "environments": {"t": env}})


def test_what_textarena_cannot_do_here_is_a_config_error():
    cases = [
        ({"type": "textarena:TicTacToe-v9"}, "did you mean TicTacToe-v0"),
        ({"type": "textarena:Chess-v0"}, "does not import on this Python"),  # textarena 0.7.4's f-string bug
        ({"type": "textarena:SecretMafia-v0"}, "set args.num_players"),
        ({"type": "textarena:TicTacToe-v0", "args": {"opponent": "nobody"}}, "opponent must be"),
        ({"type": "textarena:TicTacToe-v0", "args": {"opponent": "no_such_module:f"}}, "cannot be imported"),
        ({"type": "textarena:TicTacToe-v0", "args": {"player_id": 2}}, "not a seat of a 2-player game"),
        ({"type": "textarena:Debate-v0"}, "external LLM"),
    ]
    import nltk

    try:
        nltk.data.find("corpora/words")
    except LookupError:
        cases.append(({"type": "textarena:Wordle-v0"}, "needs the nltk resource 'words'"))
    for env, message in cases:
        with pytest.raises(ConfigError, match="environments.t.args") as err:
            _load(env)
        assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_textarena_trains_two_steps(tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=8,
                      save_every=0, log_path=str(tmp_path / "run"),
                      local={"store_dir": str(tmp_path / "store")},
                      environments={
                          "auction": {"type": "textarena:SimpleBlindAuction-v0-quick", "num_rollouts": 3,
                                      "max_turns": 4,
                                      "args": {"opponent": "random", "player_id": "alternate"}},
                          "guess": {"type": "textarena:GuessTheNumber-v0", "num_rollouts": 3, "max_turns": 3},
                      })
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["rollouts/failed"] == 0 and r["episodes/count"] == 6
    traj = [json.loads(x) for step in (0, 1)
            for x in (tmp_path / "run" / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert {t["env"] for t in traj} == {"auction", "guess"}
    for t in traj:
        assert t["error"] is None and t["num_turns"] >= 1
        assert len(t["step_rewards"]) == t["num_turns"]
        assert all(r == 0.0 for r in t["step_rewards"][:-1])  # textarena rewards only at close()
        assert -1.0 <= t["reward"] <= 1.0
        assert t["messages"][0]["role"] == "user"
        if t["env"] == "auction":
            assert t["done_by_env"] and t["metrics"]["opponent_moves"] >= 1


# ------------------------------------------------------------------------------------------ self-play


def test_self_play_plays_every_seat_with_the_policy_one_episode_each(tokenizer):
    """``opponent: self``: both seats sample from the policy (here a sampler replaying fixed moves, seat 0
    and seat 1 in turn); each seat is an episode with its own view of the game and its own reward."""
    from test_vision import ReplySampler

    from polyrl.renderers import get_renderer
    from polyrl.rl.episode import RolloutContext, RolloutSettings

    builder = make_env_builder("textarena:TicTacToe-v0", {"opponent": "self"}, seed=0)
    assert builder.drives_rollouts
    moves = ["[4]", "[0]", "[8]", "[1]", "[2]", "[3]", "[6]"]  # seat 0 takes the diagonal 2-4-6
    sampler = ReplySampler(tokenizer, moves)
    settings = RolloutSettings(max_turns=9, max_tokens=8, temperature=1.0, timeout=60)
    ctx = RolloutContext("ttt", "train", 0, 0, sampler, get_renderer("chatml", tokenizer), settings, seed=1)
    first, second = asyncio.run(builder.rollout(ctx))
    assert (first.role, second.role) == ("player0", "player1")
    assert (first.num_turns, second.num_turns) == (4, 3)
    assert (first.reward, second.reward) == (1.0, -1.0) and first.success and not second.success
    assert first.step_rewards == [0.0, 0.0, 0.0, 1.0] and second.step_rewards == [0.0, 0.0, -1.0]
    assert first.done_by_env and second.done_by_env
    assert [m["content"] for m in first.messages if m["role"] == "assistant"] == ["[4]", "[8]", "[2]", "[6]"]
    assert [m["content"] for m in second.messages if m["role"] == "assistant"] == ["[0]", "[1]", "[3]"]
    # each seat sees the other's moves in its observations, never its own echoed back
    assert "[Player 0] [4]" in second.messages[0]["content"]
    assert "[Player 1] [0]" in first.messages[2]["content"]
    assert "[Player 0]" not in "".join(m["content"] for m in first.messages if m["role"] == "user")
    assert first.metrics["seat"] == 0.0 and second.metrics["seat"] == 1.0
    # the tokens are the seats' own: each turn continues that seat's sequence
    assert first.action_tokens + second.action_tokens == sum(len(s.tokens) for s in sampler.sequences)


def test_self_play_seats_get_advantages_against_the_same_seat_of_the_group(tokenizer):
    """Three recorded games of one group (seat 0 wins, seat 1 wins, a draw), through the training step's
    own grouping and estimator: each seat is compared with the same seat of the other games."""
    from test_vision import ReplySampler

    from polyrl.renderers import get_renderer
    from polyrl.rl.advantages import compute_advantages
    from polyrl.rl.episode import RolloutContext, RolloutSettings
    from polyrl.rl.rollouts import split_roles

    builder = make_env_builder("textarena:TicTacToe-v0", {"opponent": "self"}, seed=0)
    settings = RolloutSettings(max_turns=9, max_tokens=8, temperature=1.0, timeout=60)
    games = [["[4]", "[0]", "[8]", "[1]", "[2]", "[3]", "[6]"],  # seat 0: 2-4-6
             ["[0]", "[4]", "[1]", "[2]", "[5]", "[6]"],  # seat 1: 2-4-6
             ["[0]", "[1]", "[2]", "[4]", "[3]", "[5]", "[7]", "[6]", "[8]"]]  # a full board, no line
    group = []
    for k, moves in enumerate(games):
        sampler, renderer = ReplySampler(tokenizer, moves), get_renderer("chatml", tokenizer)
        ctx = RolloutContext("ttt", "train", 0, 0, sampler, renderer, settings, seed=k)
        group += asyncio.run(builder.rollout(ctx))
    assert [(ep.role, ep.reward) for ep in group] == [("player0", 1.0), ("player1", -1.0), ("player0", -1.0),
                                                      ("player1", 1.0), ("player0", 0.0), ("player1", 0.0)]
    seats = split_roles([group])
    advantages = compute_advantages(seats)
    by_hand = {"player0": [1.0 - 0.0, -1.0 - 0.0, 0.0 - 0.0], "player1": [-1.0, 1.0, 0.0]}  # means are 0
    for seat, advs in zip(seats, advantages):
        assert [turns[0] for turns in advs] == by_hand[seat[0].role]
        assert all(len(set(turns)) == 1 and len(turns) == ep.num_turns for ep, turns in zip(seat, advs))


@pytest.mark.slow
def test_self_play_trains_with_both_seats_of_every_game(tiny_model_dir, tmp_path):
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=2, max_tokens=4,
                      save_every=0, log_path=str(tmp_path / "run"),
                      local={"store_dir": str(tmp_path / "store")}, outputs={"report": False},
                      environments={"auction": {"type": "textarena:SimpleBlindAuction-v0-quick",
                                                "num_rollouts": 4, "max_turns": 4, "splits": {"test": None},
                                                "args": {"opponent": "self"}}})
    train(cfg, ConsoleLog(enabled=False))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollouts/failed"] == 0 and r["episodes/count"] == 16 for r in rows)  # 2 x 4 games x 2
    episodes = [json.loads(x) for x in (tmp_path / "run" / "trajectories" / "step_000000.jsonl")
                .read_text().splitlines()]
    for group in (0, 1):
        roles = sorted(ep["role"] for ep in episodes if ep["group"] == group)
        assert roles == ["player0"] * 4 + ["player1"] * 4
    assert all(ep["metrics"]["seat"] == float(ep["role"][-1]) and ep["done_by_env"] for ep in episodes)


class ScriptedPartner:
    """A partner model (the ``ctx.partner`` interface: ``await partner(messages, seed) -> text``) that
    replays fixed moves and keeps the conversations it was shown."""

    label = "scripted"

    def __init__(self, moves):
        self.moves, self.views = list(moves), []

    async def __call__(self, messages, seed):
        self.views.append([dict(m) for m in messages])
        return self.moves.pop(0)

    def pick(self, seed):
        return self

    async def aclose(self):
        return None


def test_a_partner_model_plays_the_other_seat_from_its_own_view(tokenizer):
    from test_vision import ReplySampler

    from polyrl.renderers import get_renderer
    from polyrl.rl.episode import RolloutContext, RolloutSettings

    builder = make_env_builder("textarena:TicTacToe-v0", {"opponent": "partner", "player_id": "alternate"},
                               seed=0)
    assert builder.drives_rollouts and builder.wants_partner
    settings = RolloutSettings(max_turns=9, max_tokens=8, temperature=1.0, timeout=60)
    renderer = get_renderer("chatml", tokenizer)
    partner = ScriptedPartner(["[0]", "[1]", "[3]"])
    policy = ReplySampler(tokenizer, ["[4]", "[8]", "[2]", "[6]"])
    ctx = RolloutContext("ttt", "train", 0, 0, policy, renderer, settings, seed=3, partner=partner)
    (episode,) = asyncio.run(builder.rollout(ctx))  # task 0: the policy has seat 0
    assert episode.role == "" and episode.reward == 1.0 and episode.metrics["partner_moves"] == 3.0
    assert "[Player 1] [0]" in episode.messages[2]["content"]
    # the partner saw the board and the policy's moves as user messages, its own moves as its replies
    last = partner.views[-1]
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert "[Player 0] [4]" in last[0]["content"] and last[1]["content"] == "[0]"
    # task 1: the partner has seat 0 and moves first
    partner = ScriptedPartner(["[4]", "[8]", "[2]", "[6]"])
    ctx = RolloutContext("ttt", "train", 1, 0, ReplySampler(tokenizer, ["[0]", "[1]", "[3]"]), renderer,
                         settings, seed=3, partner=partner)
    (episode,) = asyncio.run(builder.rollout(ctx))
    assert episode.reward == -1.0 and "[Player 0] [4]" in episode.messages[0]["content"]
    assert episode.metrics["seat"] == 1.0 and episode.metrics["partner_moves"] == 4.0


@pytest.mark.slow
def test_train_against_the_frozen_base_as_partner(tiny_model_dir, tmp_path):
    """``partner: {}``: the policy's own base model plays the other seat, through the run's engine; an
    entry naming a partner it cannot use, or using one it does not name, is a config error."""
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    def config(partner, opponent="partner"):
        env = {"type": "textarena:SimpleBlindAuction-v0-quick", "num_rollouts": 2, "max_turns": 4,
               "splits": {"test": None}, "args": {"opponent": opponent, "player_id": "alternate"}}
        if partner is not None:
            env["partner"] = partner
        return TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=2, max_steps=1, max_tokens=4,
                           save_every=0, log_path=str(tmp_path / "run"),
                           local={"store_dir": str(tmp_path / "s")}, outputs={"report": False},
                           environments={"auction": env})

    train(config({"max_tokens": 4}), ConsoleLog(enabled=False))
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["rollouts/failed"] == 0 and row["episodes/count"] == 4
    assert row["env/auction/partner_moves"] >= 1
    for partner, opponent, problem in [(None, "partner", "plays against a partner model"),
                                       ({}, "random", "no side for a partner")]:
        with pytest.raises(ConfigError, match=problem):
            train(config(partner, opponent).model_copy(update={"log_path": str(tmp_path / opponent)}),
                  ConsoleLog(enabled=False))


def test_a_pool_of_past_selves_draws_one_member_per_game_and_keeps_the_last_n():
    from polyrl.config.env import PartnerConfig
    from polyrl.rl.chat_models import PastSelves, ServiceChat

    cfg = PartnerConfig(pool=2)
    pool = PastSelves(ServiceChat("base", None, cfg, "the policy's base model"), cfg.pool)
    assert {pool.pick(seed).step for seed in range(20)} == {0}
    pool.add(3, "after 3")
    assert {pool.pick(seed).sampler for seed in range(40)} == {"base", "after 3"}  # both drawn
    assert all(pool.pick(seed) is pool.pick(seed) for seed in range(10))  # a game's seed, one member
    pool.add(6, "after 6")  # full: the base leaves
    assert [(m.step, m.sampler) for m in pool.members] == [(3, "after 3"), (6, "after 6")]
    assert pool.members[1].label == "the policy after 6 steps"


@pytest.mark.slow
def test_train_against_a_pool_of_past_selves(tiny_model_dir, tmp_path):
    """``partner: {pool: 2}`` with a checkpoint every step: each step's games are played by the base or
    the checkpoints saved so far, at most the last two, each game recording whose (``partner_step``); a pool
    the run could never fill, or at an endpoint, is a config error."""
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    def config(partner, save_every=1, name="run"):
        return TrainConfig(model_name=tiny_model_dir, lora_rank=4, batch_size=4, max_steps=4, max_tokens=4,
                           save_every=save_every, log_path=str(tmp_path / name),
                           local={"store_dir": str(tmp_path / "s")}, outputs={"report": False},
                           environments={"auction": {
                               "type": "textarena:SimpleBlindAuction-v0-quick", "num_rollouts": 2,
                               "max_turns": 4, "splits": {"test": None}, "partner": partner,
                               "args": {"opponent": "partner", "player_id": "alternate"}}})

    train(config({"max_tokens": 4, "pool": 2}), ConsoleLog(enabled=False))
    drawn = {}
    for step in range(4):
        rows = (tmp_path / "run" / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
        drawn[step] = {json.loads(x)["metrics"]["partner_step"] for x in rows}
    assert drawn[0] == {0.0}  # the base alone
    assert drawn[1] <= {0.0, 1.0} and drawn[2] <= {1.0, 2.0} and drawn[3] <= {2.0, 3.0}  # the last two
    assert any(max(d) > 0 for d in drawn.values())  # past selves played
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollouts/failed"] == 0 for r in rows)

    # a resumed run starts with the pool it had: the last two checkpoints, not the base alone
    train(config({"max_tokens": 4, "pool": 2}).model_copy(update={"max_steps": 6}), ConsoleLog(enabled=False))
    for step in (4, 5):
        rows = (tmp_path / "run" / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
        assert {json.loads(x)["metrics"]["partner_step"] for x in rows} <= {step - 1.0, float(step)}

    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="partner.pool: past selves join the pool at every save_every"):
        config({"pool": 2}, save_every=0, name="never")
    with pytest.raises(ValidationError, match="a partner at base_url cannot be one"):
        config({"pool": 2, "model": "m", "base_url": "http://127.0.0.1:9/v1"}, name="endpoint")


@pytest.mark.slow
def test_self_play_moves_the_win_rate_of_the_seat_that_decides_the_game(tiny_model_dir, tmp_path):
    """Self-play on LetterDuel (tests/fixtures/letter_duel.py), where seat 0 wins by writing 'e's: both
    seats are the policy, and seat 0's win rate rises as it learns; every game is won by exactly one
    seat, so seat 1's rewards mirror seat 0's."""
    import tests.fixtures.letter_duel as duel
    from polyrl.rl.train import train
    from polyrl.tracking.console import ConsoleLog

    cfg = TrainConfig(model_name=tiny_model_dir, lora_rank=8, batch_size=4, max_steps=12, max_tokens=6,
                      learning_rate=3e-2, save_every=0, seed=0, log_path=str(tmp_path / "run"),
                      local={"store_dir": str(tmp_path / "store")}, outputs={"report": False},
                      environments={"duel": {"type": f"textarena:{duel.ENV_ID}", "num_rollouts": 8,
                                             "max_turns": 1, "splits": {"test": None},
                                             "args": {"opponent": "self"}}})
    train(cfg, ConsoleLog(enabled=False))
    wins = []
    for step in range(12):
        episodes = [json.loads(x) for x in (tmp_path / "run" / "trajectories" / f"step_{step:06d}.jsonl")
                    .read_text().splitlines()]
        # the seats of one game are written side by side
        games = [{ep["role"]: ep for ep in episodes[i:i + 2]} for i in range(0, len(episodes), 2)]
        assert len(games) == 32 and all(set(g) == {"player0", "player1"} for g in games)
        for g in games:  # one winner per game, decided by the writer's line
            writer = next(m["content"] for m in g["player0"]["messages"] if m["role"] == "assistant")
            assert g["player0"]["reward"] == (1.0 if duel.e_share(writer) >= duel.THRESHOLD else -1.0)
            assert g["player1"]["reward"] == -g["player0"]["reward"]
        wins.append(sum(g["player0"]["reward"] > 0 for g in games) / len(games))
    assert sum(wins[-3:]) / 3 > sum(wins[:3]) / 3 + 0.3, wins
