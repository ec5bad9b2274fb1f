"""The calculator tool (arithmetic on numbers, nothing else evaluated), and the tools of GSM8K's tool episodes: the
calculator and the sandboxed Python tool (environments/gsm8k_tools.py runs them; tasks/gsm8k.py lists them in the
prompt, task.prompt_template=tools)."""

from __future__ import annotations

import ast
import math
import operator

from grpo_stream.common.tools.functions import ToolSet, tool_from_function
from grpo_stream.common.tools.python_sandbox import SandboxLimits, python_tool

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # 10**64 is plenty for word problems; 9**9**9 would take the worker for minutes
MAX_EXPRESSION = 500
_EXACT_FLOAT_INTEGERS = 2 ** 53  # a float holds every integer up to this one; past it, its integer digits are noise
MAX_BITS = 4096  # integers the calculator makes: (3**64)**64 nested further would hold the sampler's GIL for hours


def _check_size(op: ast.operator, left, right) -> None:
    """Refuse an integer power or product whose result would pass MAX_BITS, before computing it (the exponent bound
    alone does not bound nested powers)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return  # floats overflow (OverflowError) in constant time
    bits = left.bit_length()
    if isinstance(op, ast.Pow) and right > 0 and bits * right > MAX_BITS:
        raise ValueError(f"the result would have more than {MAX_BITS} bits")
    if isinstance(op, ast.Mult) and bits + right.bit_length() > MAX_BITS:
        raise ValueError(f"the result would have more than {MAX_BITS} bits")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "(48 + 12) * 3 / 4".
    """
    if len(expression) > MAX_EXPRESSION:
        return f"error: expression longer than {MAX_EXPRESSION} characters"
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
        return f"error: {exc}; use numbers, + - * / // % ** and parentheses"
    if isinstance(value, complex):  # (-8) ** 0.5
        return "error: the result is not a real number"
    if isinstance(value, float) and not math.isfinite(value):  # 1e309
        return "error: the result is too large"
    if isinstance(value, float) and value.is_integer():
        if abs(value) > _EXACT_FLOAT_INTEGERS:  # (10**64)**0.5 is 1e+32, not 100000000000000005366162204393472
            return f"{value:.12g}"
        value = int(value)
    # 12 significant digits, not 10 decimals: 1 / 3e12 is 3.33333333333e-13, not 0
    return str(float(f"{value:.12g}") if isinstance(value, float) else value)


def _evaluate(node: ast.expr):
    """The value of an arithmetic syntax tree; anything but numbers and the operators above is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is outside -{MAX_EXPONENT}..{MAX_EXPONENT}")
        _check_size(node.op, left, right)
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not allowed")


def math_tools(limits: SandboxLimits) -> ToolSet:
    """The calculator and the Python tool under `limits`."""
    return ToolSet([tool_from_function(calculator), python_tool(limits)])


def sandbox_limits(cfg) -> SandboxLimits:
    """The Python tool's limits of a run (environment.python_tool)."""
    return SandboxLimits(**cfg.environment.python_tool.model_dump())
