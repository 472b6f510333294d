"""``visual``: single turn, a picture drawn with Pillow and a question about it; reward 1 for the right
answer in ``\\boxed{}``. It needs a vision-language model (the renderer must take images).

Kinds (arg ``kinds``, default ``["colour"]``):

- ``colour``: "What colour is the largest shape?" One large shape (a circle, square or triangle) and up
  to ``max_distractors`` small ones of other colours on a white background; the answer is the large
  shape's colour, one of :data:`COLOURS`.
- ``count``: "How many shapes are in the picture?" One to four shapes of one size, apart, in different
  colours; the answer is the number.

Args: ``kinds``, ``image_size`` (pixels a side, default 64), ``max_distractors`` (default 2),
``demo_error_rate``.

The designed demonstration mistake: for ``colour`` the demonstrator names the background
(``\\boxed{white}``) instead of the shape, a habit chosen at one token that looks at nothing; for
``count`` it leaves one shape out. The skill (reading the picture) and the habit share everything else,
so a warm-started policy reads colours and still says "white" at the demonstrated rate, which only reward
tells apart.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from polyrl.envs.answers import boxed_contents, extract_answer, parse_number
from polyrl.envs.base import Message, Observation, StepResult, ToolSpec, register_env
from polyrl.envs.builtin.base import BuiltinBuilder, Policy, SyncEnv, assistant_message, demonstrate
from polyrl.renderers.base import message_text

if TYPE_CHECKING:
    from PIL import Image as PILImage

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220),
    "yellow": (240, 200, 20), "purple": (140, 40, 170), "orange": (245, 130, 20),
}
BACKGROUND = "white"
SHAPES = ("circle", "square", "triangle")
KINDS = ("colour", "count")
QUESTIONS = {
    "colour": "What colour is the largest shape? Answer with one word in \\boxed{}.",
    "count": "How many shapes are in the picture? Put the number in \\boxed{}.",
}
MAX_COUNT = 4


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cx: int
    cy: int
    radius: int

    def key(self) -> str:
        return f"{self.kind}:{self.colour}:{self.cx},{self.cy},{self.radius}"


@dataclass(frozen=True)
class VisualTask:
    kind: str
    shapes: tuple[Shape, ...]  # the first is the largest (``colour``)
    image_size: int

    @property
    def answer(self) -> str:
        return self.shapes[0].colour if self.kind == "colour" else str(len(self.shapes))

    def key(self) -> str:
        return f"{self.kind}/{self.image_size}/" + ";".join(s.key() for s in self.shapes)

    def image(self) -> PILImage.Image:
        """The picture: drawn anew each time, the same pixels for the same task."""
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.image_size, self.image_size), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for s in self.shapes:
            box = (s.cx - s.radius, s.cy - s.radius, s.cx + s.radius, s.cy + s.radius)
            if s.kind == "circle":
                draw.ellipse(box, fill=COLOURS[s.colour])
            elif s.kind == "square":
                draw.rectangle(box, fill=COLOURS[s.colour])
            else:
                draw.polygon([(s.cx, s.cy - s.radius), (s.cx - s.radius, s.cy + s.radius),
                              (s.cx + s.radius, s.cy + s.radius)], fill=COLOURS[s.colour])
        return image


def question(task: VisualTask) -> Message:
    """The user turn: the picture, then the question (Qwen-VL's order)."""
    return {"role": "user", "content": [{"type": "image", "image": task.image()},
                                        {"type": "text", "text": QUESTIONS[task.kind]}]}


def grade(task: VisualTask, reply: str) -> tuple[float, bool]:
    """(success, whether a boxed answer was found)."""
    if task.kind == "count":
        value = parse_number(extract_answer(reply))
        return float(value is not None and value == len(task.shapes)), value is not None
    boxed = [b.strip() for b in boxed_contents(reply) if b.strip()]
    if not boxed:
        return 0.0, False
    return float(boxed[-1].strip(".").lower() == task.answer), True


def tokenizer_text() -> list[str]:
    """Text a tiny model's tokenizer is trained on so the questions and answers are few tokens."""
    answers = [f"\\boxed{{{word}}}" for word in [*COLOURS, BACKGROUND, *map(str, range(MAX_COUNT + 1))]]
    return [*QUESTIONS.values(), *answers] * 40


class VisualEnv(SyncEnv):
    def __init__(self, task: VisualTask):
        super().__init__()
        self.task = task

    def _reset(self) -> Observation:
        return Observation([question(self.task)])

    def _step(self, action: Message) -> StepResult:
        success, boxed = grade(self.task, message_text(action))
        return StepResult([], success, True, {"success": success, "format_ok": float(boxed)})


@register_env("visual")
class VisualBuilder(BuiltinBuilder):
    """Args: ``kinds`` (``colour``, ``count``), ``image_size`` (default 64), ``max_distractors`` (default
    2), ``demo_error_rate``. See the module docstring."""

    name = "visual"
    defaults = {"kinds": ["colour"], "image_size": 64, "max_distractors": 2}

    def _validate(self) -> None:
        self.kinds = self._list_arg("kinds", KINDS)
        self.image_size = self._int_arg("image_size", 32)
        if self.image_size > 1024:
            raise ValueError(f"{self.name}: image_size must be at most 1024, got {self.image_size}")
        self.max_distractors = self._int_arg("max_distractors", 0)
        if self.max_distractors > 4:
            raise ValueError(f"{self.name}: max_distractors must be at most 4, got {self.max_distractors}")

    def _sample(self, rng: random.Random) -> VisualTask:
        kind = rng.choice(self.kinds)
        size = self.image_size
        colours = rng.sample(list(COLOURS), len(COLOURS))
        if kind == "colour":
            where = _place(rng, size, [], size * 5 // 16, size * 7 // 16)
            shapes = [Shape(rng.choice(SHAPES), colours[0], *where)]
            for colour in colours[1 : 1 + rng.randint(0, self.max_distractors)]:
                where = _place(rng, size, shapes, size // 12, size // 9)
                if where is not None:
                    shapes.append(Shape(rng.choice(SHAPES), colour, *where))
            return VisualTask(kind, tuple(shapes), size)
        shapes = []
        radius = size // 8
        for colour in colours[: rng.randint(1, MAX_COUNT)]:
            where = _place(rng, size, shapes, radius, radius)
            if where is not None:
                shapes.append(Shape(rng.choice(SHAPES), colour, *where))
        return VisualTask(kind, tuple(shapes), size)

    def task(self, split: str, index: int) -> VisualTask:
        return self._draw(split, index, self._sample, VisualTask.key)

    def make(self, split: str, index: int) -> VisualEnv:
        return VisualEnv(self.task(split, index))

    def demonstration(self, split: str, index: int) -> tuple[list[Message], list[ToolSpec]]:
        task = self.task(split, index)
        answer = task.answer
        if self._demo_has_error(split, index):
            answer = BACKGROUND if task.kind == "colour" else str(len(task.shapes) - 1)

        def expert() -> Policy:
            yield assistant_message(f"\\boxed{{{answer}}}")

        return demonstrate(VisualEnv(task), expert())


def _place(rng: random.Random, size: int, others: list[Shape], low: int, high: int,
           tries: int = 50) -> tuple[int, int, int] | None:
    """A centre and radius inside the picture, clear of ``others`` (None when there is no room)."""
    for _ in range(tries):
        radius = rng.randint(low, high)
        margin = radius + 1
        if 2 * margin >= size:
            return None
        cx, cy = rng.randint(margin, size - margin), rng.randint(margin, size - margin)
        if all(math.hypot(cx - o.cx, cy - o.cy) > radius + o.radius + 2 for o in others):
            return cx, cy, radius
    return None
