"""Write the RLHF example's demonstrations, demos.jsonl: arithmetic questions answered the way the
preference pairs prefer (the right number, said plainly), in TRL's prompt-completion form for
``polyrl sft --data``. The questions are drawn apart from examples/dpo's pairs (another seed).

    python examples/rlhf/make_demos.py examples/rlhf
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SYSTEM = {"role": "system", "content": "Answer with the number only."}


def demo(rng: random.Random) -> dict:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return {"prompt": [SYSTEM, {"role": "user", "content": f"What is {a} + {b}?"}],
            "completion": [{"role": "assistant", "content": str(a + b)}]}


def main(out: Path) -> None:
    rng = random.Random(1)
    (out / "demos.jsonl").write_text("".join(json.dumps(demo(rng)) + "\n" for _ in range(32)))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
