"""An OpenReward environment served on 127.0.0.1 by OpenReward's own ORS server (the openreward package):
what train.yaml trains on. Start it first, in its own terminal:

    python examples/openreward/server.py              # http://127.0.0.1:8080; --port to change it

LetterWords asks for a word of at least N letters that contains a given letter. The model may call the
``check`` tool on a candidate first (feedback, no reward); a plain reply is its answer, graded by the
hidden terminal tool ``answer`` (reward 1 or 0) and ending the episode. Write your own environment the
same way: an ``Environment`` subclass with ``list_splits``, ``list_tasks``, ``get_prompt`` and ``@tool``
methods (see OpenReward's documentation).
"""

from __future__ import annotations

import argparse
import string

from openreward.environments import Environment, Server, TextBlock, ToolOutput, terminal, tool
from pydantic import BaseModel

LENGTHS = {"train": (3, 4, 5, 6), "test": (7,)}  # held out: longer words


class Word(BaseModel):
    word: str


class Answer(BaseModel):
    answer: str


class LetterWords(Environment):
    """Write a word of at least ``min_length`` letters containing ``letter``."""

    def __init__(self, task_spec: dict = {}, secrets: dict = {}):  # noqa: B006 - the SDK's signature
        super().__init__(task_spec, secrets)
        self.letter, self.min_length = task_spec["letter"], task_spec["min_length"]

    @classmethod
    def list_splits(cls):
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str):
        return [{"letter": letter, "min_length": n}
                for n in LENGTHS[split] for letter in string.ascii_lowercase]

    def get_prompt(self):
        return [TextBlock(text=f"Write a word of at least {self.min_length} letters that contains the letter "
                               f"{self.letter!r}. Reply with the word alone.")]

    def problems(self, word: str) -> list[str]:
        word = word.strip().strip(".!\"'*`").lower()
        found = []
        if not word.isalpha():
            found.append("use letters only")
        if len(word) < self.min_length:
            found.append(f"{word!r} has {len(word)} letters, fewer than {self.min_length}")
        if self.letter not in word:
            found.append(f"{word!r} has no {self.letter!r}")
        return found

    @tool
    async def check(self, params: Word) -> ToolOutput:
        """Check a candidate word before answering (no reward)."""
        found = self.problems(params.word)
        text = "; ".join(found) if found else "ok"
        return ToolOutput(blocks=[TextBlock(text=text)], reward=0.0, finished=False)

    @terminal
    @tool
    def answer(self, params: Answer) -> ToolOutput:
        """Grade the final answer."""
        ok = not self.problems(params.answer)
        return ToolOutput(blocks=[TextBlock(text="correct" if ok else "wrong")], reward=float(ok),
                          finished=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    Server([LetterWords]).run(host=args.host, port=args.port)


if __name__ == "__main__":
    main()
