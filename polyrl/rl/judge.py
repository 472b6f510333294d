"""An environment's LLM judge (``environments.<name>.judge``): every finished episode is graded against
rubric items, and the judge's score, in [0, 1], is added to its reward.

The judge reads the conversation up to the episode's last reply (``{context}``), that reply
(``{answer}``) and one rubric item (``{rubric}``), and gives its score between ``scale``'s ends
(``{low}``, ``{high}``) in ``<score>...</score>``: the last such tag of its verdict counts. An episode's
score is the mean over its rubric items (a task's own, a dataset row's ``rubrics``, else the config's),
mapped onto [0, 1]; ``reward += weight * score``.

With ``mode: yes_no`` the judge writes nothing: after the conversation it is asked whether the reply
meets the rubric item, and the score is the probability it gives ``Yes`` over ``Yes`` and ``No``, read
from ``compute_logprobs``. Even a model too small to follow the verdict format grades this way.

With ``mode: pairwise`` the judge compares the group's replies two by two instead, in both orders (so
neither place is favoured), answering ``<preferred>A|B|tie</preferred>``; a reply's score is its win
rate, a tie counting half.

A verdict without a readable score in range, a call that fails or times out: the episode fails with a
``JudgeError`` (counted against the group's failure budget, as an environment's error is), never a
silent zero. Each call's prompt, verdict and score is kept on the episode (``Episode.judge``), written
with its trajectory and shown in the report.

The judge is a model on the run's own service (the policy's base model by default: the same weights,
no second copy; another base model; a ``tinker://`` checkpoint) or a model behind an OpenAI-compatible
endpoint. Calls run at most ``max_concurrency`` at once (the local engine batches those in flight),
each bounded by ``timeout``; identical prompts (the same answer to the same task and rubric) are judged
once while the verdict is cached, so a group's equal answers get equal scores.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

from polyrl.backend import ServiceGuard
from polyrl.config.env import JudgeConfig
from polyrl.errors import ServiceLostError
from polyrl.rl.chat_models import ChatModel, ServiceChat, open_chat_model, preview, text_of
from polyrl.rl.episode import Episode, RolloutSettings, check_rewards, decide_success, render

if TYPE_CHECKING:
    from polyrl.clients import ServiceClient
    from polyrl.renderers.base import Renderer

VERDICT = re.compile(r"<score>\s*([-+]?\d+(?:\.\d+)?)\s*</score>", re.IGNORECASE)
PREFERRED = re.compile(r"<preferred>\s*(A|B|tie)\s*</preferred>", re.IGNORECASE)
NO_RUBRIC = "no rubric: the task has no rubrics and the judge's rubrics are empty"
QUESTION = "Is the assistant's last reply a good one? Answer Yes or No."  # a reward model's question
YES_NO_TEMPLATE = "Rubric: {rubric}\nDoes the assistant's last reply meet the rubric? Answer Yes or No."
YES = "Yes"
CACHE_SIZE = 4096  # verdicts kept for reuse, per judge

# --8<-- [start:template]
TEMPLATE = """\
You grade a chatbot's reply against one rubric item.

<context>
{context}
</context>

<reply>
{answer}
</reply>

<rubric>
{rubric}
</rubric>

Judge the reply by the rubric item alone. Explain in one or two sentences, then give your score, a \
number from {low} (fails the item) to {high} (meets it fully), as <score>NUMBER</score>."""
# --8<-- [end:template]

# --8<-- [start:pair_template]
PAIR_TEMPLATE = """\
You compare two chatbot replies against one rubric item.

<context>
{context}
</context>

<reply_a>
{answer_a}
</reply_a>

<reply_b>
{answer_b}
</reply_b>

<rubric>
{rubric}
</rubric>

Which reply meets the rubric item better? Explain in one or two sentences, then answer \
<preferred>A</preferred>, <preferred>B</preferred> or, if they meet it equally, <preferred>tie</preferred>."""
# --8<-- [end:pair_template]


class JudgeError(Exception):
    """The judge gave no readable verdict for an episode, or its call failed: the episode fails."""


def transcript(messages: list[dict]) -> tuple[str, str]:
    """The conversation before the last assistant message, one ``Role: text`` paragraph per message, and
    that message's text (with its tool calls)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        return "\n\n".join(f"{m.get('role', '?').capitalize()}: {text_of(m.get('content'))}"
                           for m in messages), ""
    context = "\n\n".join(f"{m.get('role', '?').capitalize()}: {text_of(m.get('content'))}"
                          for m in messages[:last]) or "(none)"
    reply = messages[last]
    answer = text_of(reply.get("content"))
    for call in reply.get("tool_calls") or []:
        fn = call.get("function", {})
        answer += f"\n[tool call {fn.get('name')}({fn.get('arguments')})]"
    return context, answer


def read_score(verdict: str, scale: tuple[float, float]) -> tuple[float, float]:
    """The verdict's last ``<score>`` as (raw, mapped onto [0, 1]); a :class:`JudgeError` if it has none
    or it is outside ``scale``."""
    found = VERDICT.findall(verdict)
    low, high = scale
    if not found:
        raise JudgeError(f"the verdict has no <score>NUMBER</score>: {preview(verdict)}")
    raw = float(found[-1])
    if not low <= raw <= high:
        raise JudgeError(f"the verdict's score {raw:g} is outside [{low:g}, {high:g}]: {preview(verdict)}")
    return raw, (raw - low) / (high - low)


def read_preference(verdict: str) -> str:
    """The verdict's last ``<preferred>``: ``A``, ``B`` or ``tie``; a :class:`JudgeError` if it has none."""
    found = PREFERRED.findall(verdict)
    if not found:
        raise JudgeError(f"the verdict has no <preferred>A|B|tie</preferred>: {preview(verdict)}")
    choice = found[-1].strip()
    return "tie" if choice.lower() == "tie" else choice.upper()


def yes_token(tokenizer: Any) -> int:
    """The token ``Yes`` starts with: where a reward model's scalar head is read."""
    ids = tokenizer.encode(YES, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the tokenizer encodes {YES!r} as no tokens")
    return ids[0]


def scored_tokens(renderer: Renderer, messages: list, tools: list | None, question: str, yes: int):
    """A reward model's input: the conversation, ``question``, the start of the model's answer, then
    ``Yes``; the last token's logprob is the score. Returns the tokens and the images among them."""
    rendered = render(renderer, [*messages, {"role": "user", "content": question}], tools or None)
    return [*rendered.tokens, yes], rendered.images


def fill(template: str, **fields: str) -> str:
    """``template`` with each ``{field}`` replaced (other braces, such as a JSON example's, kept)."""
    for key, value in fields.items():
        template = template.replace("{" + key + "}", value)
    return template


class Judge:
    """Grades an environment's episodes (see the module docstring); ``model(messages, seed)`` answers."""

    def __init__(self, cfg: JudgeConfig, model: ChatModel, settings: RolloutSettings):
        self.cfg, self.model, self.settings = cfg, model, settings
        self._slots: asyncio.Semaphore | None = None
        self._cache: OrderedDict[str, asyncio.Future] = OrderedDict()

    @property
    def label(self) -> str:
        return self.model.label

    async def grade_group(self, episodes: list[Episode], rubrics_of: Callable[[Episode], list[str]]) -> None:
        """Grade every episode that did not fail, concurrently (``pairwise``: against each other); one the
        judge cannot grade fails."""
        if self.cfg.mode == "pairwise":
            await self._compare_group([ep for ep in episodes if not ep.failed], rubrics_of)
        elif self.cfg.mode == "reward_model":
            await asyncio.gather(*(self._reward_model_grade(ep) for ep in episodes if not ep.failed))
        else:
            await asyncio.gather(*(self.grade(ep, rubrics_of(ep)) for ep in episodes if not ep.failed))

    async def grade(self, episode: Episode, rubrics: list[str]) -> None:
        try:
            if not rubrics:
                raise JudgeError(NO_RUBRIC)
            context, answer = transcript(episode.messages)
            yes_no = self.cfg.mode == "yes_no"
            items = [self._yes_no(episode, r) if yes_no else self._score(context, answer, r) for r in rubrics]
            episode.judge = list(await asyncio.gather(*items))
            failed = [r for r in episode.judge if r["failure"]]
            if failed:
                raise JudgeError(failed[0]["error"])
            self._reward(episode, sum(r["score"] for r in episode.judge) / len(episode.judge))
        except ServiceLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - the episode fails, counted like an environment's error
            episode.error = f"{type(exc).__name__}: {exc}"

    async def _compare_group(self, episodes: list[Episode],
                             rubrics_of: Callable[[Episode], list[str]]) -> None:
        """Every ordered pair of the group's replies, per rubric item (both orders, so neither place is
        favoured): each reply's score is its win rate, a tie counting half. A comparison without a readable
        preference is left out (and counted); a reply none of whose comparisons could be read fails."""
        if not episodes:
            return
        rubrics = rubrics_of(episodes[0])  # one task per group
        if not rubrics or len(episodes) == 1:
            for ep in episodes:  # nothing to compare with: no score to give
                ep.error = f"JudgeError: {NO_RUBRIC if not rubrics else 'a pairwise judge needs 2 replies'}"
            return
        context = transcript(episodes[0].messages)[0]
        answers = [transcript(ep.messages)[1] for ep in episodes]
        n = len(episodes)
        jobs = [(a, b, r) for a in range(n) for b in range(n) if a != b for r in rubrics]
        records = await asyncio.gather(*(self._compare(context, answers[a], answers[b], r, a, b)
                                         for a, b, r in jobs))
        wins, counts = [0.0] * len(episodes), [0] * len(episodes)
        for record in records:
            a, b = record["pair"]
            episodes[a].judge.append(record)
            episodes[b].judge.append(record)
            if record["failure"] is None:
                share = {"A": 1.0, "B": 0.0, "tie": 0.5}[record["preferred"]]
                wins[a], wins[b] = wins[a] + share, wins[b] + 1.0 - share
                counts[a], counts[b] = counts[a] + 1, counts[b] + 1
        for k, ep in enumerate(episodes):
            try:
                if not counts[k]:
                    raise JudgeError(next(r["error"] for r in ep.judge if r["failure"]))
                self._reward(ep, wins[k] / counts[k])
            except Exception as exc:  # noqa: BLE001 - as in grade
                ep.error = f"{type(exc).__name__}: {exc}"

    async def _yes_no(self, episode: Episode, rubric: str) -> dict[str, Any]:
        """Mode ``yes_no``: the judge is asked whether the reply meets ``rubric`` and its answer is read, not
        written: the score is P(Yes) / (P(Yes) + P(No)) for the first token of its answer."""
        question = fill(self.cfg.template or YES_NO_TEMPLATE, rubric=rubric)
        record = self._record(rubric, question)
        try:
            tokenizer = self._service_model().renderer.tokenizer
            no = tokenizer.encode("No", add_special_tokens=False)[0]
            p_yes, p_no = (math.exp(lp) for lp in await self._answer_logprobs(episode, question, record,
                                                                                 [yes_token(tokenizer), no]))
            record["verdict"] = f"P(Yes) = {p_yes:.4g}, P(No) = {p_no:.4g}"
            record["raw_score"] = p_yes
            record["score"] = p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.5
        except ServiceLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded: the episode fails
            record.update(failure="call", error=f"the judge failed: {type(exc).__name__}: {exc}")
        return record

    async def _reward_model_grade(self, episode: Episode) -> None:
        """A reward model's score: the logprob it gives ``Yes`` after the episode and its question (a
        Bradley-Terry score: its differences, not its level, are what the model learned)."""
        question = self.cfg.template or QUESTION
        record = self._record(None, question)
        try:
            yes = yes_token(self._service_model().renderer.tokenizer)
            (logprob,) = await self._answer_logprobs(episode, question, record, [yes])
            record["raw_score"] = record["score"] = logprob
            episode.judge = [record]
            self._reward(episode, record["score"])
        except ServiceLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - as in grade
            record.update(failure="call", error=f"the reward model failed: {type(exc).__name__}: {exc}")
            episode.judge = [record]
            episode.error = f"JudgeError: {record['error']}"

    def _service_model(self) -> ServiceChat:
        assert isinstance(self.model, ServiceChat)  # the config refuses an endpoint for the modes read
        return self.model

    @staticmethod
    def _record(rubric: str | None, prompt: str) -> dict[str, Any]:
        return {"rubric": rubric, "prompt": prompt, "verdict": None, "score": None, "raw_score": None,
                "seconds": 0.0, "cached": False, "failure": None, "error": None}

    async def _answer_logprobs(self, episode: Episode, question: str, record: dict[str, Any],
                               answers: list[int]) -> list[float]:
        """The judge's logprob of each of ``answers`` as the first token of its answer to ``question``
        after the episode (one ``compute_logprobs`` each, within the judge's slots and timeout); the
        seconds they took go into ``record``."""
        from polyrl import images

        model = self._service_model()
        tokens, spans = scored_tokens(model.renderer, episode.messages, episode.tools, question, answers[0])
        started = time.monotonic()
        async with self._slot():
            asked = [model.sampler.compute_logprobs(images.model_input([*tokens[:-1], answer], spans))
                     for answer in answers]
            logprobs = await asyncio.wait_for(asyncio.gather(*asked), self.cfg.timeout)
        record["seconds"] = time.monotonic() - started
        if any(lps[-1] is None for lps in logprobs):
            raise JudgeError("compute_logprobs gave no logprob for the answer token")
        return [float(lps[-1] or 0.0) for lps in logprobs]  # none is None (checked above)

    def _reward(self, episode: Episode, score: float) -> None:
        """Add ``weight * score`` to the episode's reward (and its last turn's), and decide its success."""
        episode.metrics["judge/score"] = score
        bonus = self.cfg.weight * score
        episode.reward += bonus
        if episode.turn_rewards:
            episode.turn_rewards[-1] += bonus
        decide_success(episode, self.settings)
        check_rewards(episode, self.settings.max_abs_reward)

    async def _score(self, context: str, answer: str, rubric: str) -> dict[str, Any]:
        low, high = self.cfg.scale
        prompt = fill(self.cfg.template or TEMPLATE, context=context, answer=answer, rubric=rubric,
                      low=f"{low:g}", high=f"{high:g}")
        record = await self._verdict(prompt, {"rubric": rubric, "score": None, "raw_score": None})
        if record["failure"] is None:
            try:
                record["raw_score"], record["score"] = read_score(record["verdict"], self.cfg.scale)
            except JudgeError as exc:
                record.update(failure="parse", error=str(exc))
        return record

    async def _compare(self, context: str, answer_a: str, answer_b: str, rubric: str, a: int,
                       b: int) -> dict[str, Any]:
        prompt = fill(self.cfg.template or PAIR_TEMPLATE, context=context, answer_a=answer_a,
                      answer_b=answer_b, rubric=rubric)
        record = await self._verdict(prompt, {"rubric": rubric, "pair": [a, b], "preferred": None})
        if record["failure"] is None:
            try:
                record["preferred"] = read_preference(record["verdict"])
            except JudgeError as exc:
                record.update(failure="parse", error=str(exc))
        return record

    async def _verdict(self, prompt: str, record: dict[str, Any]) -> dict[str, Any]:
        """The judge's answer to ``prompt`` (reused while it is cached) in ``record``, with its seconds,
        whether it was reused, and a failed call's reason."""
        record.update(prompt=prompt, verdict=None, seconds=0.0, cached=True, failure=None, error=None)
        future = self._cache.get(prompt)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._cache[prompt] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            record["cached"] = False
            started = time.monotonic()
            try:
                future.set_result(await self._call(prompt))
            except ServiceLostError:
                self._cache.pop(prompt, None)
                future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - recorded; a failed call is not kept for reuse
                self._cache.pop(prompt, None)
                future.set_exception(exc)
                future.exception()  # retrieved: waiters on it see it, no "never retrieved" warning
            record["seconds"] = time.monotonic() - started
        else:
            self._cache.move_to_end(prompt)
            await asyncio.wait([future])
        if future.cancelled() or future.exception() is not None:
            problem = future.exception() if not future.cancelled() else JudgeError("the call was cancelled")
            timeout = isinstance(problem, asyncio.TimeoutError)
            record.update(failure="timeout" if timeout else "call",
                          error=(f"the judge ({self.label}) took over {self.cfg.timeout:g}s" if timeout
                                 else f"the judge call failed: {type(problem).__name__}: {problem}"))
        else:
            record["verdict"] = future.result()
        return record

    def _slot(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.cfg.max_concurrency)
        return self._slots

    async def _call(self, prompt: str) -> str:
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")
        async with self._slot():
            return await asyncio.wait_for(self.model([{"role": "user", "content": prompt}], seed),
                                          self.cfg.timeout)

    async def aclose(self) -> None:
        await self.model.aclose()


def judge_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The step's judge counts over ``episodes`` (failed ones included): ``judge/calls`` made,
    ``judge/cached`` verdicts reused, ``judge/seconds`` the calls took (summed), ``judge/parse_failures``
    (verdicts without a readable score) and ``judge/call_failures`` (errors and timeouts)."""
    records = list({id(r): r for ep in episodes for r in ep.judge}.values())  # a comparison is two episodes'
    if not records:
        return {}
    return {"judge/calls": float(sum(not r["cached"] for r in records)),
            "judge/cached": float(sum(r["cached"] for r in records)),
            "judge/seconds": float(sum(r["seconds"] for r in records)),
            "judge/parse_failures": float(sum(r["failure"] == "parse" for r in records)),
            "judge/call_failures": float(sum(r["failure"] in ("call", "timeout") for r in records))}


async def open_judge(cfg: JudgeConfig, settings: RolloutSettings, model_name: str, service: ServiceClient,
                     guard: ServiceGuard, renderer: Renderer, where: str) -> Judge:
    """The judge ``cfg`` names (see :class:`~polyrl.config.env.JudgeConfig`), on the run's ``service``
    (whose policy is ``model_name``, in ``renderer``'s chat format) unless it is an endpoint."""
    return Judge(cfg, await open_chat_model(cfg, model_name, service, guard, renderer, where), settings)
