"""A request body's JSON as the endpoint reads it (`parse`): JSON only, with text only, each refusal naming where.

Python's json module reads more than JSON: NaN, Infinity and -Infinity, and numbers too large for a float (1e400) as
infinite; each is refused naming its field, so no such value reaches a check, a template or the engine (a request's
`"temperature": Infinity` was told to send the policy's temperature, a tool schema's NaN was written into a prompt).
JSON's escapes also allow a lone UTF-16 surrogate, which is no Unicode text: the tokenizer, the templates and the
answer's own encoding all failed on it (a 500 and an error line each).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how JSON writes a UTF-16 surrogate (paired or not)


class BodyValueError(ValueError):
    """A value of the body the endpoint does not read; `field` is where it lies."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class BodyTextError(BodyValueError):
    """A string of the body that is not Unicode text."""

    def __init__(self, field: str):
        super().__init__(f"{field}: holds an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                         "which is no Unicode text; send valid text", field)


class _NonFinite:
    """Where the body held a number that is no finite JSON number (as it was written)."""

    def __init__(self, text: str):
        self.text = text[:20] + "..." if len(text) > 23 else text


def _finite_float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _first(value: Any, bad: Callable[[Any], bool]) -> tuple[Any, str] | None:
    """(the item, where it lies) of the first item (or key) of `value` that is `bad`; a key is placed at its dict."""
    stack = [(value, "")]
    while stack:
        item, where = stack.pop()
        if bad(item):
            return item, where or "the body"
        if isinstance(item, dict):
            for key, inner in item.items():
                stack += [(key, where or "the body"), (inner, f"{where}.{key}" if where else str(key))]
        elif isinstance(item, list):
            stack += [(inner, f"{where}[{i}]") for i, inner in enumerate(item)]
    return None


def _not_text(item: Any) -> bool:
    if not isinstance(item, str):
        return False
    try:
        item.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _printable(where: str) -> str:
    return where.encode("utf-8", "backslashreplace").decode()


def parse(body: bytes) -> Any:
    """The body's JSON; ValueError naming the position for one that is not JSON, BodyValueError naming the field of
    a number that is not finite or a string that is not Unicode text (RecursionError for one nested deeper than
    Python's parser goes)."""
    non_finite = []

    def constant(text: str) -> _NonFinite:
        non_finite.append(True)
        return _NonFinite(text)

    def number(text: str) -> Any:
        value = _finite_float(text)
        if isinstance(value, _NonFinite):
            non_finite.append(True)
        return value

    try:
        parsed = json.loads(body or b"null", parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the body is not JSON ({exc.msg} at position {exc.pos})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"the body is not UTF-8 JSON (byte {exc.start} is not UTF-8)") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ValueError(f"the body holds a number this endpoint does not read ({str(exc).split(':')[0]}); no "
                         "field takes one that long") from None
    if non_finite:
        item, where = _first(parsed, lambda item: isinstance(item, _NonFinite))
        where = _printable(where)
        raise BodyValueError(f"{where}: {item.text} is not a finite number (JSON has no NaN or Infinity); send a "
                             "finite number or leave the field out", where)
    if _SURROGATE_ESCAPE.search(body or b""):
        found = _first(parsed, _not_text)
        if found is not None:
            raise BodyTextError(_printable(found[1]))
    return parsed
