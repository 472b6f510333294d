"""Write demonstrations of the last-word task as JSONL, one conversation a line, for ``polyrl sft``.

Run: ``python examples/own_task/make_demos.py runs/last_word/demos.jsonl``. Each line is a conversation in
the OpenAI chat format, the same messages the environment shows the model (system prompt, the question)
and the expert's reply::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "tiger piano lemon"},
                  {"role": "assistant", "content": "lemon"}]}

Conversations you have (logs, a stronger model's answers, written by hand) go in the same format.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from last_word import SYSTEM_PROMPT, make_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the JSONL file to write")
    p.add_argument("--num", type=int, default=1000, help="how many demonstrations (default: 1000)")
    p.add_argument("--seed", type=int, default=100, help="seed of the word lists (default: 100)")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in make_rows(args.num, args.seed):
            messages = [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": row["question"]},
                        {"role": "assistant", "content": row["answer"]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(out)


if __name__ == "__main__":
    main()
