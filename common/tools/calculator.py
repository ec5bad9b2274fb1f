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
# the operators refused, by what the model wrote: "BinOp is not allowed" named nothing to change (2 ^ 3 for a power)
_REFUSED = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@",
            ast.Invert: "~", ast.Not: "not"}
MAX_EXPONENT = 64  # 10**64 is plenty for word problems; 9**9**9 would take the worker for minutes
MAX_EXPRESSION = 500
_EXACT_FLOAT_INTEGERS = 2 ** 53  # a float holds every integer up to this one; past it, its integer digits are noise
MAX_BITS = 4096  # integers the calculator makes: (3**64)**64 nested further would hold the sampler's GIL for hours
DIGITS = 12  # significant digits of a float answer: float noise (0.1 + 0.2 is 0.30000000000000004) never shows
_FLOAT_DIGITS = 15  # the most digits any float holds of a decimal (DBL_DIG)


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
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)  # " 3 + 4" was an "unexpected indent"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:  # (1e300) ** 2 said "(34, 'Numerical result out of range')"
        return "error: the result is too large: past a float's ±1.8e308"
    except (SyntaxError, ValueError, TypeError) as exc:
        return f"error: {exc}; use numbers, + - * / // % ** and parentheses"
    if isinstance(value, complex):  # (-8) ** 0.5
        return "error: the result is not a real number"
    if isinstance(value, float) and not math.isfinite(value):  # 1e309
        return "error: the result is too large"
    if isinstance(value, float) and value.is_integer():
        if abs(value) > _EXACT_FLOAT_INTEGERS:  # (10**64)**0.5 is 1e+32, not 100000000000000005366162204393472
            return f"{value:.{DIGITS}g}"
        value = int(value)
    return _float_text(value) if isinstance(value, float) else str(value)


def _float_text(value: float) -> str:
    """A non-integral float answer: DIGITS significant digits (not 10 decimals: 1 / 3e12 is 3.33333333333e-13, not
    0), more for one of more than 10 integer digits, so its integer part and two decimals are kept, up to the 15 a
    float holds; written as formatted, never read back as a float, whose text filled the digits dropped with zeros
    (987654321 * 1234.5 was 1219259259270.0, off by 4.5 and written as if exact)."""
    digits = min(_FLOAT_DIGITS, max(DIGITS, len(str(int(abs(value)))) + 2))
    return f"{value:.{digits}g}"


def _shown_number(value) -> str:
    """`value` for an error text: an integer of over 20 digits by its size (2 ** ((2**64)**63) was answered with its
    exponent's 1,214 digits, an error that filled the episode's tokens instead of saying what to change)."""
    text = str(value)
    return f"of {len(text.lstrip('-'))} digits" if isinstance(value, int) and len(text) > 20 else text


def _evaluate(node: ast.expr):
    """The value of an arithmetic syntax tree; anything but numbers and the operators above is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in _REFUSED:
        symbol = _REFUSED[type(node.op)]
        raise ValueError(f"{symbol} is not allowed{'; a power is written **' if symbol == '^' else ''}")
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {_shown_number(right)} is outside -{MAX_EXPONENT}..{MAX_EXPONENT}")
        _check_size(node.op, left, right)
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not allowed")


def math_tools(limits: SandboxLimits) -> ToolSet:
    """The calculator and the Python tool under `limits`."""
    return ToolSet([tool_from_function(calculator), python_tool(limits)])


def sandbox_limits(cfg) -> SandboxLimits:
    """The Python tool's limits of a run (environment.python_tool)."""
    return SandboxLimits(**cfg.environment.python_tool.model_dump())
