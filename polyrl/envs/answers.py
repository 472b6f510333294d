"""Reading a model's final answer, and exact arithmetic on the expressions it writes.

Any environment may use these: the built-ins, ``python_tool``, ``reasoning_gym``, the workflows.

Answer format: the final answer is the content of the last ``\\boxed{...}`` in the reply; without a
box, the last number (:func:`extract_answer`). :func:`answer_value` reads it as a number and
:func:`same_number` compares it exactly with a target.

Expressions (``(3+5)*2``) are parsed with ``ast`` and walked by hand; nothing is ever ``eval``-ed
(:func:`evaluate_expression`).
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Callable

__all__ = [
    "ExpressionError",
    "answer_value",
    "boxed_contents",
    "evaluate_expression",
    "extract_answer",
    "parse_number",
    "same_number",
]

# --------------------------------------------------------------------------------------------------
# Answer parsing.

# A number not glued to a preceding digit or dot, so "12-5" yields 12 and 5 (not -5), with optional
# thousands separators ("1,234") and decimals.
_NUMBER_RE = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_INT_RE = re.compile(r"[+-]?\d+")
_FLOAT_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_BOX = "\\boxed{"


def boxed_contents(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{...}``, in order (nested braces allowed)."""
    found = []
    start = text.find(_BOX)
    while start != -1:
        depth, i = 1, start + len(_BOX)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append(text[start + len(_BOX) : i - 1])
        start = text.find(_BOX, start + 1)
    return found


def extract_answer(text: str | None) -> str | None:
    """The final answer in a reply: the last non-empty ``\\boxed{...}`` content, else the last number.

    The fallback keeps replies like "The answer is 57." gradable: a tiny model drifting from the
    box format during RL should still be scored on what it computed.
    """
    if not text:
        return None
    boxed = [b.strip() for b in boxed_contents(text) if b.strip()]
    if boxed:
        return boxed[-1]
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> int | float | None:
    """``text`` as a number if it is exactly one (ints stay exact); tolerates ``$``, ``1,234``, a
    trailing period and a unicode minus. ``None`` otherwise."""
    if text is None:
        return None
    s = text.strip().replace("\u2212", "-").strip("$").strip()
    if s.endswith(".") and s[:-1].strip():
        s = s[:-1].strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if _INT_RE.fullmatch(s):
        return int(s)
    if _FLOAT_RE.fullmatch(s):
        return float(s)
    return None


def answer_value(text: str | None) -> int | float | None:
    """The numeric final answer of a reply: :func:`extract_answer` parsed by :func:`parse_number`.

    A box holding more than a number ("\\boxed{x = 57}") falls back to its last number.
    """
    answer = extract_answer(text)
    value = parse_number(answer)
    if value is None and answer is not None:
        numbers = _NUMBER_RE.findall(answer)
        value = parse_number(numbers[-1]) if numbers else None
    return value


def same_number(value: int | float | None, target: int | Fraction) -> bool:
    """Whether a parsed answer equals ``target`` (exactly, up to 1e-9 for decimals); ``None`` never does."""
    return value is not None and abs(Fraction(value) - Fraction(target)) < Fraction(1, 10**9)


# --------------------------------------------------------------------------------------------------
# Safe arithmetic: parsed with ``ast`` and walked by hand; nothing is ever ``eval``-ed.


class ExpressionError(ValueError):
    """An expression that is not plain arithmetic or cannot be evaluated."""


_MAX_EXPRESSION_CHARS = 200  # bounds recursion depth and integer sizes (there is no ** operator)
_OPS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def evaluate_expression(
    expression: str, *, allow_decimals: bool = False, allow_unary: bool = False
) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integer literals it uses, in order.

    Only ``+ - * /``, parentheses and non-negative integer literals are allowed (decimal literals
    and unary minus on request). A character whitelist runs first so literals like ``0x10`` or
    ``1_000`` cannot sneak through Python's grammar. Raises :class:`ExpressionError`.
    """
    expr = expression.strip().replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    if not expr:
        raise ExpressionError("empty expression")
    if len(expr) > _MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    allowed = set("0123456789+-*/() \t") | ({"."} if allow_decimals else set())
    bad = sorted(set(expr) - allowed)
    if bad:
        raise ExpressionError(f"invalid character {bad[0]!r}")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ExpressionError("invalid syntax") from e
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ExpressionError("division by zero")
            return _OPS[type(node.op)](left, right)
        if allow_unary and isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        if allow_decimals and isinstance(node, ast.Constant) and type(node.value) is float:
            return Fraction(str(node.value))  # via str: Fraction(0.1) would be binary-inexact
        raise ExpressionError(f"unsupported syntax ({type(node).__name__})")

    return walk(tree.body), literals
