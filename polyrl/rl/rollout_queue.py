"""The bounded queue between sampling and training.

Groups are drawn in plan order (plan step by plan step, each step's groups in their planned order,
see :func:`polyrl.rl.rollouts.plan_step`) and each is started as soon as a slot is free; the trainer takes
finished groups into its step's :class:`StepBatch`, the stalest first, and releases their slots together
with the sampler of the weights they trained. Every episode samples through the queue's
:class:`~polyrl.rl.episode.SamplerRef`, which the release swaps: each turn (and each ``chunk_tokens`` of a
long turn) is sampled by the newest weights, and each token records its sampler step (partial rollouts).
A group's sampler step is that of the oldest token its episodes sampled. ``capacity`` bounds the groups
started but not yet trained on:

- ``batch_size`` is the synchronous loop: a step's groups start only once the previous step has
  trained and the trainer has released their slots with the new sampler in place, so every group is
  sampled by the policy it trains;
- ``batch_size * (K + 1)`` lets sampling run up to K steps ahead: the next steps' groups are in
  flight while this one trains. A group with a token sampled more than ``max_staleness`` updates behind
  the step that takes it (a straggler whose first turns were sampled before faster groups were trained)
  is dropped, counted and replaced by a fresh one, or trained anyway when ``max_staleness`` is None.

Resume is by draw position: :meth:`RolloutQueue.draw_point` is the first plan step that still has a
group not consumed (trained or dropped), the data cursors before it, and the groups of that step and
later that are consumed. A relaunch draws from there and skips those, so every group is consumed
once, whatever was in flight at the kill; with a capacity of one batch that is simply the next step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from polyrl.rl.episode import Episode, SamplerRef

if TYPE_CHECKING:
    from polyrl.clients import SamplingClient

Key = tuple[int, int]  # (plan step, position in that step's plan)
Plan = Callable[[int, dict[str, int]], tuple[list[tuple[str, int]], dict[str, int]]]
Sample = Callable[[int, int, str, int, SamplerRef], Awaitable[list[Episode]]]


@dataclass
class Group:
    """A finished group: its episodes, where it was drawn and the oldest policy that sampled it."""

    drawn: int  # the plan step that drew it
    index: int  # its position in that step's plan
    episodes: list[Episode]
    sampler_step: int  # optimizer steps the weights that sampled its oldest token had seen

    @property
    def key(self) -> Key:
        return (self.drawn, self.index)

    def order(self) -> tuple[int, int, int]:
        """Stalest first, then in plan order."""
        return (self.sampler_step, self.drawn, self.index)


@dataclass
class DrawPoint:
    """Where drawing resumes: plan step ``step`` from ``cursors``, skipping the ``consumed`` groups."""

    step: int
    cursors: dict[str, int]
    consumed: list[Key] = field(default_factory=list)


@dataclass
class StepBatch:
    """A step's batch: the groups taken from the queue for it so far (``taken``, the stalest first),
    the groups dropped as stale on the way, and the seconds spent waiting for them."""

    step: int
    size: int
    taken: list[Group] = field(default_factory=list)
    stale: list[Group] = field(default_factory=list)
    seconds: float = 0.0

    @classmethod
    def of(cls, step: int, episodes_G: list[list[Episode]], sampler_step: int | None = None) -> StepBatch:
        """A whole batch of groups already sampled (by the policy after ``sampler_step`` updates, by
        default ``step``)."""
        version = step if sampler_step is None else sampler_step
        taken = [Group(step, i, episodes, version) for i, episodes in enumerate(episodes_G)]
        return cls(step, len(episodes_G), taken=taken)

    @property
    def missing(self) -> int:
        """How many groups the batch still lacks."""
        return self.size - len(self.taken)

    @property
    def episodes_G(self) -> list[list[Episode]]:
        return [g.episodes for g in self.taken]

    @property
    def staleness(self) -> list[int]:
        """Per group: how many updates its oldest token's sampler is behind the policy this step trains."""
        return [self.step - g.sampler_step for g in self.taken]

    def add(self, taken: list[Group], stale: list[Group], seconds: float) -> list[list[Episode]]:
        """Groups just taken from the queue (and those dropped as stale meanwhile, after ``seconds`` of
        waiting); each group's episodes are numbered by the group's place in the batch. Returns the
        episodes of the groups taken."""
        for position, group in enumerate(taken, start=len(self.taken)):
            for ep in group.episodes:
                ep.group_id = position
        self.taken += taken
        self.stale += stale
        self.seconds += seconds
        return [g.episodes for g in taken]


class RolloutQueue:
    """Rollout workers feeding the trainer (see the module docstring).

    ``plan(step, cursors)`` gives a plan step's ``(environment, task)`` list and the cursors after it;
    ``sample(step, index, environment, task, samplers)`` runs one group, each turn with ``samplers``'
    newest; ``sampler`` is the first sampler and ``sampler_step`` the updates its weights have seen
    (:meth:`release` hands over the next); ``chunk_tokens`` the most tokens a turn samples before asking
    for the newest again (None: whole turns); ``wanted`` is how many groups the trainer will still take
    (nothing is started that could not be trained). Sampling starts with the first :meth:`take`, in its
    event loop.
    """

    def __init__(self, plan: Plan, sample: Sample, sampler: SamplingClient, sampler_step: int, capacity: int,
                 wanted: int, start: DrawPoint, max_staleness: int | None, chunk_tokens: int | None = None):
        self.capacity, self.max_staleness = capacity, max_staleness
        self._plan_fn, self._sample = plan, sample
        self.samplers = SamplerRef(sampler, sampler_step, chunk_tokens)  # what every episode samples with
        self._wanted = wanted
        self._cursors_at = {start.step: dict(start.cursors)}  # cursors before each plan step drawn from
        self._consumed: set[Key] = {tuple(k) for k in start.consumed}  # type: ignore[misc]
        self._next: Key = (start.step, 0)  # the next group to draw
        self._plan: list[tuple[str, int]] | None = None  # the plan of self._next's step, once computed
        self._running: dict[Key, asyncio.Task] = {}
        self._ready: list[Group] = []
        self._held = 0  # taken by the trainer, slot not released yet
        self._failure: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._producer: asyncio.Task | None = None

    # ---- the trainer's side -----------------------------------------------------------------------
    async def take(self, n: int, step: int, on_ready: Callable[[int], None] | None = None
                   ) -> tuple[list[Group], list[Group]]:
        """Wait until ``n`` finished groups can train ``step``, and take the ``n`` stalest; also return
        the groups dropped on the way as stale. ``on_ready`` hears how many of the ``n`` are ready."""
        changed = self._begin()
        stale: list[Group] = []
        while True:
            if self._failure is not None:
                raise self._failure
            if self.max_staleness is not None:
                for group in [g for g in self._ready if step - g.sampler_step > self.max_staleness]:
                    self._ready.remove(group)
                    self._consumed.add(group.key)
                    stale.append(group)
                    changed.set()  # its slot is free again: the producer draws a replacement
            if on_ready is not None:
                on_ready(min(n, len(self._ready)))
            if len(self._ready) >= n:
                break
            changed.clear()
            await changed.wait()
        self._ready.sort(key=Group.order)
        taken, self._ready = self._ready[:n], self._ready[n:]
        self._consumed.update(g.key for g in taken)
        self._held += n
        self._wanted -= n
        return taken, stale

    def release(self, n: int, sampler: SamplingClient, sampler_step: int) -> None:
        """Free the slots of ``n`` groups the trainer took, once it trained on them: the turns sampled
        from now on, in new groups and those in flight, sample with ``sampler``, whose weights have seen
        ``sampler_step`` updates."""
        self.samplers.swap(sampler, sampler_step)
        self._held -= n
        first = self.draw_point().step  # what precedes the oldest open draw is never asked about again
        self._consumed = {k for k in self._consumed if k[0] >= first}
        self._cursors_at = {s: c for s, c in self._cursors_at.items() if s >= first}
        if self._changed is not None:
            self._changed.set()

    def draw_point(self) -> DrawPoint:
        """Where a relaunch draws again: groups started but not taken are drawn anew from here."""
        step, index = self._next
        if self._plan is not None and index >= len(self._plan):
            step = step + 1
        first = min([step] + [key[0] for key in self._running] + [g.drawn for g in self._ready])
        consumed = sorted(k for k in self._consumed if k[0] >= first)
        return DrawPoint(first, dict(self._cursors_at[first]), consumed)

    async def close(self) -> None:
        """Cancel the producer and every group in flight (their environments are closed)."""
        loop = asyncio.get_running_loop()
        tasks = [t for t in (self._producer, *self._running.values())
                 if t is not None and not t.done() and t.get_loop() is loop]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    # ---- the producer's side ----------------------------------------------------------------------
    def _begin(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
            self._producer = asyncio.ensure_future(self._produce())
        return self._changed

    def _room(self) -> bool:
        open_groups = len(self._running) + len(self._ready)
        return open_groups < self._wanted and open_groups + self._held < self.capacity

    async def _produce(self) -> None:
        assert self._changed is not None
        try:
            while True:
                while not self._room():
                    self._changed.clear()
                    await self._changed.wait()
                key, env_name, task = self._draw()
                self._running[key] = asyncio.ensure_future(self._run(key, env_name, task))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer by take()
            self._fail(exc)

    def _draw(self) -> tuple[Key, str, int]:
        """The next group in plan order that is not consumed yet."""
        while True:
            step, index = self._next
            if self._plan is None:
                self._plan, self._cursors_at[step + 1] = self._plan_fn(step, self._cursors_at[step])
            if index >= len(self._plan):
                self._next, self._plan = (step + 1, 0), None
                continue
            self._next = (step, index + 1)
            if (step, index) not in self._consumed:
                env_name, task = self._plan[index]
                return (step, index), env_name, task

    async def _run(self, key: Key, env_name: str, task: int) -> None:
        started = self.samplers.step
        try:
            episodes = await self._sample(key[0], key[1], env_name, task, self.samplers)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer by take()
            self._fail(exc)
        else:
            self._ready.append(Group(key[0], key[1], episodes, oldest_sampler_step(episodes, started)))
        finally:
            self._running.pop(key, None)
            assert self._changed is not None
            self._changed.set()

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        assert self._changed is not None
        self._changed.set()


def oldest_sampler_step(episodes: list[Episode], started: int) -> int:
    """The sampler step of the oldest token the group's episodes sampled (failed episodes left out: they
    are not trained); ``started``, the step of the sampler the group started with, when none did."""
    return min((s for ep in episodes if not ep.failed for s in ep.sampled_steps() if s >= 0), default=started)
