"""textarena games (``pip install textarena``): ``type: textarena:<env_id>``.

Single-player games (``textarena:GuessTheNumber-v0``, ``textarena:TowerOfHanoi-v0``, ...) and games
for two or more players in which the policy plays one seat and every other seat is played by an
opponent that is not trained::

    environments:
      tictactoe:
        type: textarena:TicTacToe-v0
        max_turns: 9
        args:
          opponent: random          # random | first | self | partner | {actions: [...]} | pkg.module:f
          player_id: alternate      # the policy's seat: an int (default 0) or alternate (by task index)

``opponent: self`` is self-play: the policy plays every seat. Each seat is an episode of its own, with
the role ``player<seat>``: its conversation is what that seat saw (the other seats' moves arrive in its
observations as ``[Player k] ...`` lines), its reward is the game's reward for that seat, and
advantages are computed per seat within the group, each seat compared with the same seat of the
group's other games. The seats' episodes of one game are written to the trajectories side by side
(same step, group and draw).

``opponent: partner`` puts a model in the other seats: the entry's ``partner:`` (the policy's frozen base
model by default, or another model, a ``tinker://`` checkpoint, an OpenAI-compatible endpoint; see
:mod:`polyrl.rl.chat_models`). It is not trained: each of its seats keeps its own conversation (the
game's observations as user messages, its moves as its replies), and the policy's seat is an episode as
against any opponent; ``partner_moves`` counts its moves. With ``partner: {pool: N}`` the partner is a pool
of past selves: each game draws one of the run's last N saved checkpoints (the frozen base among them until
it is pushed out), and ``partner_step`` says how many steps that one had trained.

Opponents: ``random`` picks uniformly among the moves its observation offers (the last
"available/valid moves" list, else any ``[...]`` in it), seeded per task; ``first`` always takes the
first one (a fixed deterministic policy); ``{actions: [...]}`` replays fixed actions in turn;
``package.module:name`` imports a callable ``f(observation: str) -> str`` or a textarena ``Agent``
class (constructed with ``opponent_kwargs``). Opponents see their accumulated observation text, as
textarena's ``LLMObservationWrapper`` shows it.

Episodes: the reset observation (the game prompt and board) is the first user message; after each
policy move the opponents move until it is the policy's turn again, and everything the policy's seat
observed meanwhile is the next user message (``[GAME] ...`` / ``[Player 1] ...`` lines). textarena
gives rewards only from ``close()``: the policy's entry is the final step's reward. Rewards are
validated as numbers (textarena's ``Countdown-v0`` returns a string when a move is invalid): a
non-numeric or non-finite reward counts as 0 and sets the ``reward_invalid`` metric. An episode is a
success when that reward is at least ``success_reward`` (default 1.0: a win, or a solved puzzle).
Action wrappers of the registered id (e.g. bracket formatting) apply; observation wrappers are not
used, since the conversation already keeps the history.

Args: ``opponent``, ``opponent_kwargs``, ``player_id``, ``num_players`` (default: 1 if the game
accepts one player, else 2), ``env_kwargs`` (kwargs for ``textarena.make``), ``success_reward``,
``system_prompt``.

Tasks are seeds derived from (run seed, env id, split, index): even for train, odd for test, so the
splits never share one. textarena seeds and draws from the process-global ``random`` state: every
textarena call runs on the episode's private copy of it (:mod:`polyrl.envs.global_rng`).

At config load the game is created and reset once: games that need nltk data (word games) or an
external LLM key, games for more players than configured, and games whose source does not import
here are config errors.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import random
import re
import time
from typing import Any, Callable

from polyrl.envs.base import Message, Observation, StepResult, register_env
from polyrl.envs.game_adapter import GameBuilder, GameEnv, GameSpec, one_line
from polyrl.envs.global_rng import PrivateGlobalRng
from polyrl.rl.episode import Episode, RolloutContext, check_observation_tokens, finalize_reward, render

_ARGS = ("opponent", "opponent_kwargs", "player_id", "num_players", "env_kwargs", "success_reward",
         "system_prompt")
_GAME_ID = -1
_MAX_OPPONENT_MOVES = 10_000
_MOVE_LIST = re.compile(r"(?:available|valid|legal|possible)[^\n:]*(?:moves?|actions?)[^\n:]*:([^\n]*)", re.I)
_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")

# (env_id, env_kwargs, num_players) -> a created-and-reset game to copy episodes from
_PROTOTYPES: dict[str, Any] = {}


def _import_textarena():
    try:
        with PrivateGlobalRng().active():
            import textarena
    except ImportError as exc:
        raise ValueError(
            f"textarena environments need the textarena package ({exc}): pip install textarena"
        ) from exc
    return textarena


def _innermost(env: Any) -> Any:
    import textarena as ta

    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def _format(observation: Any, role_mapping: dict[int, str] | None = None,
            skip_sender: int | None = None) -> str:
    """textarena messages ``[(sender, text, type), ...]`` as ``[GAME] text`` lines (messages from
    ``skip_sender``, the policy's own moves already in the conversation, left out); strings as is."""
    if observation is None:
        return ""
    if isinstance(observation, str):
        return observation
    lines = []
    for item in observation:
        sender, text = item[0], item[1]
        if skip_sender is not None and sender == skip_sender:
            continue
        if not isinstance(sender, int) or sender == _GAME_ID:
            name = "GAME"
        else:
            name = (role_mapping or {}).get(sender, f"Player {sender}")
        lines.append(f"[{name}] {text}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ opponents


def offered_moves(observation: str) -> list[str]:
    """The moves an observation offers: the ``[...]`` items of its last "Available moves: ..." style
    line, else every ``[...]`` in it (in order, without repeats)."""
    for line in reversed(_MOVE_LIST.findall(observation)):
        moves = _BRACKETED.findall(line)
        if moves:
            return list(dict.fromkeys(moves))
    return list(dict.fromkeys(_BRACKETED.findall(observation)))


class _ScriptedOpponent:
    def __init__(self, mode: str, seed: int, actions: list[str] | None = None):
        self.mode, self.actions, self.turn = mode, actions or [], 0
        self.rng = random.Random(seed)

    def __call__(self, observation: str) -> str:
        self.turn += 1
        if self.mode == "actions":
            return self.actions[(self.turn - 1) % len(self.actions)]
        moves = offered_moves(observation) or ["[0]"]
        return moves[0] if self.mode == "first" else self.rng.choice(moves)


def _resolve_opponent(spec: Any, kwargs: dict[str, Any]) -> Callable[[int], Callable[[str], str]]:
    """A factory ``seed -> opponent`` for the ``opponent`` arg; raises ValueError when it is invalid."""
    if spec in ("self", "partner"):
        raise ValueError(f"opponent {spec!r} needs a game for two or more players")
    if spec in ("random", "first"):
        return lambda seed: _ScriptedOpponent(spec, seed)
    if isinstance(spec, dict):
        actions = spec.get("actions")
        if set(spec) != {"actions"} or not isinstance(actions, list) or not actions or not all(
            isinstance(a, str) for a in actions
        ):
            raise ValueError(
                f"opponent mapping must be {{actions: [non-empty list of strings]}}, got {spec!r}"
            )
        return lambda seed: _ScriptedOpponent("actions", seed, actions)
    if isinstance(spec, str) and ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            target = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"opponent {spec!r} cannot be imported: {exc}") from exc
        if not callable(target):
            raise ValueError(f"opponent {spec!r} is not callable")
        if isinstance(target, type):
            cls = target
            return lambda seed: cls(**kwargs)
        if kwargs:
            raise ValueError("opponent_kwargs are only used with an opponent class")
        return lambda seed: target
    raise ValueError(
        f"opponent must be 'random', 'first', 'self', 'partner', {{actions: [...]}} or "
        f"'package.module:callable', "
        f"got {spec!r}"
    )


# ------------------------------------------------------------------------------------------ spec


class _Spec(GameSpec):
    """Parsed and checked type + args of one ``textarena:`` entry."""

    prefix, package, example, known_args = "textarena", "textarena", "textarena:TicTacToe-v0", _ARGS

    def __init__(self, type_name: str, args: dict[str, Any]):
        super().__init__(type_name, args)
        self.player_id = args.get("player_id", 0)
        if self.player_id != "alternate" and (not isinstance(self.player_id, int)
                                              or isinstance(self.player_id, bool) or self.player_id < 0):
            raise ValueError(
                f"player_id must be a seat number (0, 1, ...) or 'alternate', got {self.player_id!r}"
            )
        num_players = args.get("num_players")
        if num_players is not None and (not isinstance(num_players, int) or isinstance(num_players, bool)
                                        or num_players < 1):
            raise ValueError(f"num_players must be a positive integer, got {num_players!r}")
        opponent_kwargs = args.get("opponent_kwargs") or {}
        if not isinstance(opponent_kwargs, dict):
            raise ValueError(f"opponent_kwargs must be a mapping, got {opponent_kwargs!r}")

        _import_textarena()
        from textarena.envs.registration import ENV_REGISTRY

        self.check_env_id(ENV_REGISTRY)
        self.num_players = num_players or self._detect_players()
        _prototype(self)  # created and reset once: unsupported games fail here
        if isinstance(self.player_id, int) and self.player_id >= self.num_players:
            raise ValueError(f"player_id {self.player_id} is not a seat of a {self.num_players}-player game")
        self.self_play = args.get("opponent") == "self" and self.num_players > 1
        self.partner_play = args.get("opponent") == "partner" and self.num_players > 1
        self.opponent = _resolve_opponent(args.get("opponent", "random"), opponent_kwargs) \
            if self.num_players > 1 and not (self.self_play or self.partner_play) else None
        if self.self_play and "player_id" in args:
            raise ValueError("player_id does not apply to self-play (opponent: self): the policy plays every "
                             "seat")

    def _detect_players(self) -> int:
        errors: list[ValueError] = []
        for n in (1, 2):  # textarena has no player-count API: the game's reset refuses a wrong count
            try:
                _prototype(self, n)
                return n
            except ValueError as exc:
                errors.append(exc)
        other = [e for e in errors if not isinstance(e, _PlayerCountError)]
        if other:
            raise other[0]
        raise ValueError(f"textarena {self.env_id!r} plays with neither 1 nor 2 players ({errors[-1]}); "
                         "set args.num_players")

    def key(self, num_players: int) -> str:
        return json.dumps([self.env_id, self.env_kwargs, num_players], sort_keys=True, default=str)


class _PlayerCountError(ValueError):
    pass


def _create(spec: _Spec, num_players: int) -> Any:
    import textarena as ta

    env = ta.make(spec.env_id, **spec.env_kwargs)
    env.reset(num_players=num_players, seed=0)
    return env


def _prototype(spec: _Spec, num_players: int | None = None) -> Any:
    n = num_players or spec.num_players
    key = spec.key(n)
    if key not in _PROTOTYPES:
        sink = io.StringIO()
        try:
            with (PrivateGlobalRng(0).active(), contextlib.redirect_stdout(sink),
                  contextlib.redirect_stderr(sink)):
                _PROTOTYPES[key] = _create(spec, n)
        except AssertionError as exc:  # textarena checks the player count with asserts
            raise _PlayerCountError(f"textarena {spec.env_id!r} with {n} players: {exc}") from exc
        except LookupError as exc:
            resource = re.search(r"Resource\s+(\S+)\s+not found", str(exc))
            name = resource.group(1) if resource else "its nltk data"
            download = f"python -m nltk.downloader {name.strip(chr(39))}"
            raise ValueError(
                f"textarena {spec.env_id!r} needs the nltk resource {name}, which is not installed here "
                f"(textarena would try to download it): run `{download}` "
                "with network access, or point NLTK_DATA at a copy"
            ) from exc
        except SyntaxError as exc:
            raise ValueError(f"textarena {spec.env_id!r} does not import on this Python (a bug in the "
                             f"installed textarena): {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - any failure of the package becomes one clear line
            msg = one_line(exc)
            if "API key" in msg or "api_key" in msg:
                msg += " (this game needs an external LLM service, which polyrl does not provide)"
            raise ValueError(
                f"textarena {spec.env_id!r} cannot be created here: {type(exc).__name__}: {msg}"
            ) from exc
    return _PROTOTYPES[key]


# ------------------------------------------------------------------------------------------ episodes


def _quiet() -> contextlib.AbstractContextManager:
    """Some games print progress to stdout; keep it out of the training console."""
    return contextlib.redirect_stdout(io.StringIO())


class TextArenaEnv(GameEnv):
    """One game: the policy's seat against the opponents, on a private global-RNG stream."""

    spec: _Spec

    def __init__(self, spec: _Spec, seed: int, player: int):
        super().__init__(spec, seed)
        self.player = player
        self.opponents: dict[int, Callable[[str], str]] = {}
        self.histories: dict[int, list[Any]] = {}
        self.opponent_moves = 0

    @property
    def inner(self) -> Any:
        return _innermost(self.env)

    def _roles(self) -> dict[int, str]:
        return getattr(getattr(self.inner, "state", None), "role_mapping", None) or {}

    def _text(self, observation: Any) -> str:
        return _format(observation, self._roles(), skip_sender=self.player)

    def _current(self) -> int:
        return self.inner.state.current_player_id

    def _done(self) -> bool:
        return bool(getattr(self.inner.state, "done", False))

    def _run_opponents(self) -> bool:
        """Opponents move until it is the policy's turn; True when the game ended meanwhile."""
        for _ in range(_MAX_OPPONENT_MOVES):
            if self._done():
                return True
            pid = self._current()
            if pid == self.player:
                return False
            if pid not in self.opponents:
                self.opponents[pid] = self.spec.opponent(self.seed * 31 + pid)
            _, observation = self.inner.get_observation()
            self.histories.setdefault(pid, []).extend(observation or [])
            action = self.opponents[pid](_format(self.histories[pid], self._roles()))
            self.opponent_moves += 1
            done, _ = self.env.step(str(action))
            if done:
                return True
        raise RuntimeError(f"opponents made {_MAX_OPPONENT_MOVES} moves without the policy getting a turn")

    async def reset(self) -> Observation:
        with self.rng.active(), _quiet():
            self.env = self.fresh_game(_prototype(self.spec),
                                       lambda: _create(self.spec, self.spec.num_players))
            self.env.reset(num_players=self.spec.num_players, seed=self.seed)
            if self.spec.num_players > 1 and self._run_opponents():
                raise RuntimeError("the game ended before the policy's first move")
            pid, observation = self.inner.get_observation()
        if pid != self.player:
            raise RuntimeError(f"expected player {self.player} to move first, textarena says player {pid}")
        return self.first_observation(self._text(observation))

    async def step(self, action: Message) -> StepResult:
        text = action.get("content") or ""
        with self.rng.active(), _quiet():
            done, _ = self.env.step(text if isinstance(text, str) else str(text))
            if not done and self.spec.num_players > 1:
                done = self._run_opponents()
            if not done:
                pid, observation = self.inner.get_observation()
                if pid != self.player:
                    raise RuntimeError(f"expected player {self.player}'s turn, textarena says player {pid}")
                return StepResult([{"role": "user", "content": self._text(observation)}], 0.0, False,
                                  {"success": 0.0})
            pending = self.inner.state.observations.get(self.player, [])
            closed = self.env.close()
        rewards, game_info = closed if isinstance(closed, tuple) and len(closed) == 2 else (closed, {})
        raw = (rewards or {}).get(self.player) if isinstance(rewards, dict) else None
        reward, metrics = self.checked_reward(raw)
        info = (game_info or {}).get(self.player, {}) if isinstance(game_info, dict) else {}
        invalid_move = bool(info.get("invalid_move", False)) if isinstance(info, dict) else False
        metrics["invalid_move"] = float(invalid_move)
        metrics["opponent_moves"] = float(self.opponent_moves)
        metrics["success"] = self.success(reward)
        final = self._text(pending)
        reason = info.get("reason") if isinstance(info, dict) else None
        if reason and str(reason) not in final:
            final = (final + "\n" if final else "") + f"[GAME] {reason}"
        return StepResult([{"role": "user", "content": final}] if final else [], reward, True, metrics)


@register_env("textarena:")
class TextArenaBuilder(GameBuilder):
    """``textarena:<env_id>``: see the module docstring."""

    spec_class = _Spec
    spec: _Spec

    @classmethod
    def validate_args(cls, type_name: str, args: dict[str, Any]) -> None:
        _Spec(type_name, args)

    @property
    def drives_rollouts(self) -> bool:
        return self.spec.self_play or self.spec.partner_play

    @property
    def wants_partner(self) -> bool:
        """Whether the entry needs a ``partner:`` model (``opponent: partner``)."""
        return self.spec.partner_play

    async def rollout(self, ctx: RolloutContext) -> list[Episode]:
        """Self-play (``opponent: self``: every seat sampled from the policy, one episode per seat) or play
        against the entry's partner model (``opponent: partner``: the policy's seat is the one episode);
        see the module docstring."""
        started = time.monotonic()
        game = TextArenaEnv(self.spec, self.task_seed(ctx.split, ctx.task_index), player=-1)
        with game.rng.active(), _quiet():
            game.env = game.fresh_game(_prototype(self.spec),
                                       lambda: _create(self.spec, self.spec.num_players))
            game.env.reset(num_players=self.spec.num_players, seed=game.seed)
        if self.spec.self_play:
            seats, partner = {pid: ctx.episode(f"player{pid}") for pid in range(self.spec.num_players)}, None
        else:
            if ctx.partner is None:
                raise RuntimeError("opponent: partner, but the entry's partner model was not opened")
            player = self.spec.player_id
            seat = ctx.task_index % self.spec.num_players if player == "alternate" else player
            seats = {seat: ctx.episode()}
            partner = ctx.partner.pick(ctx.seed or 0)  # one model plays the other seats all game
        partner_views: dict[int, list[Message]] = {}
        done, partner_moves = False, 0
        for turn in range(ctx.settings.max_turns * self.spec.num_players):
            with game.rng.active(), _quiet():
                pid, observation = game.inner.get_observation()
            seen = _format(observation, game._roles(), skip_sender=pid)
            if pid in seats:
                episode = seats[pid]
                self._observe(episode, ctx, game, [seen])
                reply = await ctx.sample(episode, stream=pid)
                text = reply.get("content") or ""
            else:  # the partner's seat: its own view, its own conversation, never trained
                view = partner_views.setdefault(pid, list(game.first_observation("").messages[:-1]))
                view.append({"role": "user", "content": seen})
                assert partner is not None
                text = await partner(view, ((ctx.seed or 0) * 1009 + 7919 * pid + turn) % 2**31)
                view.append({"role": "assistant", "content": text})
                partner_moves += 1
            with game.rng.active(), _quiet():
                done, _ = game.env.step(text if isinstance(text, str) else str(text))
            if done:
                break
        rewards: Any = {}
        infos: Any = {}
        if done:
            with game.rng.active(), _quiet():
                pending = {pid: list(game.inner.state.observations.get(pid, [])) for pid in seats}
                closed = game.env.close()
            rewards, infos = closed if isinstance(closed, tuple) and len(closed) == 2 else (closed, {})
        played = [ep for ep in seats.values() if ep.turn_spans]  # a seat that never moved trains nothing
        if not played:
            raise RuntimeError("the game ended before the policy's first move")
        for pid, episode in seats.items():
            if not episode.turn_spans:
                continue
            raw = (rewards or {}).get(pid) if isinstance(rewards, dict) else None
            reward, metrics = game.checked_reward(raw)
            info = (infos or {}).get(pid, {}) if isinstance(infos, dict) else {}
            metrics.update(invalid_move=float(bool(isinstance(info, dict) and info.get("invalid_move"))),
                           success=game.success(reward), seat=float(pid))
            if self.spec.partner_play:
                metrics["partner_moves"] = float(partner_moves)
                if getattr(partner, "step", None) is not None:  # a past self: the steps it had trained
                    metrics["partner_step"] = float(partner.step)
            if done:
                final = _format(pending[pid], game._roles(), skip_sender=pid)
                reason = info.get("reason") if isinstance(info, dict) else None
                if reason and str(reason) not in final:
                    final = (final + "\n" if final else "") + f"[GAME] {reason}"
                if final:
                    episode.messages.append({"role": "user", "content": final})
            episode.step_rewards = [0.0] * (episode.num_turns - 1) + [reward]
            episode.metrics.update(metrics)
            episode.done_by_env = bool(done)
            episode.duration_s = time.monotonic() - started
            finalize_reward(episode, ctx.settings)
        return played

    def _observe(self, episode: Episode, ctx: RolloutContext, game: TextArenaEnv, texts: list[str]) -> None:
        """What seat ``episode`` observed since its last move, appended: the game's first observation as
        its prompt (after the system prompt), later ones as a user message."""
        if not episode.tokens:
            messages = game.first_observation("\n".join(texts)).messages
            episode.messages = list(messages)
            episode.append_rendered(check_observation_tokens(render(ctx.renderer, messages), ctx.settings))
            return
        messages = [{"role": "user", "content": "\n".join(texts)}]
        episode.messages.extend(messages)
        finished = episode.stop_reasons[-1] == "stop"
        episode.append_rendered(check_observation_tokens(render(ctx.renderer, messages, finished=finished),
                                                         ctx.settings))

    def make(self, split: str, index: int) -> TextArenaEnv:
        player = self.spec.player_id
        if player == "alternate":
            player = index % self.spec.num_players
        return TextArenaEnv(self.spec, self.task_seed(split, index), player)
