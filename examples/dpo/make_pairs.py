"""Write the example's preference pairs: arithmetic questions whose chosen answer is the right number,
said plainly, and whose rejected answer is a wrong one, wrapped in words: pairs.jsonl to learn and
held_out.jsonl to score. Every pair is generated, so the held-out questions are new ones.

    python examples/dpo/make_pairs.py examples/dpo
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SYSTEM = {"role": "system", "content": "Answer with the number only."}
WORDY = ["I think it is {}.", "Probably {}, give or take.", "That would be {}, I believe.", "Hmm, {}?"]


def pair(rng: random.Random) -> dict:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
    return {"prompt": [SYSTEM, {"role": "user", "content": f"What is {a} + {b}?"}],
            "chosen": [{"role": "assistant", "content": str(a + b)}],
            "rejected": [{"role": "assistant", "content": rng.choice(WORDY).format(wrong)}]}


def main(out: Path) -> None:
    rng = random.Random(0)
    for name, count in (("pairs.jsonl", 96), ("held_out.jsonl", 32)):
        lines = [json.dumps(pair(rng)) for _ in range(count)]
        (out / name).write_text("".join(line + "\n" for line in lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
