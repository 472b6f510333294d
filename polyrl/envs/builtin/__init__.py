"""Built-in environments: procedurally generated, offline, cheap, and verifiable.

They exist so polyrl can be tested and demonstrated end to end without any network or external
package: a tiny model can be warm-started on their demonstrations and then improved by RL.

One environment per module -- :mod:`.arithmetic`, :mod:`.countdown`, :mod:`.guess_number`,
:mod:`.calculator`, and :mod:`.visual` (pictures drawn with Pillow, for vision-language models) -- on
the shared machinery of :mod:`.base`; importing this package registers all five. Answers are read by
:mod:`polyrl.envs.answers`: the content of the last ``\\boxed{...}`` in the reply, without a box the
last number, or for ``countdown`` the last arithmetic run of the reply (:func:`countdown_expression`).
Prompts ask for the box and demonstrations use it (``\\boxed{57}``, ``\\boxed{(3+5)*2}``), except
``guess_number`` whose replies are a bare number (``8``).

Tasks are deterministic functions of (builder seed, split, index). Each split has its own random
stream, and the task space is additionally partitioned by a hash of the task (about 1/8 held out for
``test``), so test problems never appear in train (except ``guess_number``, whose task space is a
handful of secrets).

``demo_error_rate`` makes a fixed, per-task fraction of demonstrations contain one *consistent*
mistake (dropped carries, missed targets, linear search, an operand left out of the calculator call),
so a supervised warm start leaves RL something real to fix.
"""

from polyrl.envs.answers import (
    ExpressionError,
    answer_value,
    evaluate_expression,
    extract_answer,
    parse_number,
)
from polyrl.envs.builtin.arithmetic import (
    ArithmeticBuilder,
    ArithmeticEnv,
    ArithmeticTask,
    arithmetic_mistake,
)
from polyrl.envs.builtin.calculator import (
    CALCULATOR_TOOL,
    CalculatorBuilder,
    CalculatorEnv,
    CalculatorTask,
    run_calculator,
)
from polyrl.envs.builtin.countdown import CountdownBuilder, CountdownEnv, CountdownTask, countdown_expression
from polyrl.envs.builtin.guess_number import GuessNumberBuilder, GuessNumberEnv
from polyrl.envs.builtin.visual import VisualBuilder, VisualEnv, VisualTask

__all__ = [
    "CALCULATOR_TOOL",
    "ArithmeticBuilder",
    "ArithmeticEnv",
    "ArithmeticTask",
    "CalculatorBuilder",
    "CalculatorEnv",
    "CalculatorTask",
    "CountdownBuilder",
    "CountdownEnv",
    "CountdownTask",
    "ExpressionError",
    "GuessNumberBuilder",
    "GuessNumberEnv",
    "VisualBuilder",
    "VisualEnv",
    "VisualTask",
    "answer_value",
    "arithmetic_mistake",
    "countdown_expression",
    "evaluate_expression",
    "extract_answer",
    "parse_number",
    "run_calculator",
]
