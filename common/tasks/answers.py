"""Final answers of math word problems: find them in text, normalise them, compare them.

GSM8K references end in `#### N`; models answer in whatever format the prompt
template asked for (`#### N`, `<answer>N</answer>` as in the Tunix GSM8K demo,
`\\boxed{N}`, "the answer is N"). A number is compared as an exact rational,
after removing what people write around numbers:

- thousands separators (`1,234`, `1 234`, `1_234`), a leading `+`, the
  Unicode minus;
- currency signs and codes before or after (`$`, `€`, `£`, `¥`, `USD`), units
  of percent (`50%` equals `50`: GSM8K states percentages as bare numbers);
- trailing zeros and points (`10.50` = `10.5`, `7.` = `7`, `3.0` = `3`);
- fractions and mixed numbers (`3/4` = `0.75`, `1 1/2` = `1.5`, LaTeX
  `\\frac{3}{4}`).

A decimal written with k >= 2 places also matches a fraction that rounds to
it (`0.33` matches `1/3`), since a model cannot write 1/3 as a decimal exactly.
"""

from __future__ import annotations

import re
from fractions import Fraction

_CURRENCY = re.compile(r"(?i)(?:us\$|\$|€|£|¥|₹|usd|eur|gbp|dollars?|cents?)")
_FRAC_LATEX = re.compile(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}")
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:\s+\d+/\d+|/\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_PATTERNS = (  # where a completion states its final answer, most explicit first
    re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S),
    re.compile(r"####[ \t]*((?=[-+$€£¥₹.\d\\\u2212])[^\n]*)"),  # a number follows: not a markdown heading
    re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}"),
    re.compile(r"(?i)the (?:final )?answer is[:\s]*([^\n]*)"),
)


def parse_number(text: str) -> Fraction | None:
    """The exact value of one written number (see the module docstring), or None if `text` is not one."""
    s = text.strip().replace("\u2212", "-").replace("\u2009", " ").replace("_", "")
    s = _FRAC_LATEX.sub(lambda m: f"{m.group(1)}/{m.group(2)}", s)
    s = _CURRENCY.sub("", s).strip().rstrip(".").strip()
    if s.endswith("%"):
        s = s[:-1].strip()
    s = re.sub(r"(?<=\d) (?=\d{3}\b)", "", s)  # "1 234" -> "1234"
    s = s.replace("{", "").replace("}", "").strip()
    if not s or _NUMBER_RE.fullmatch(s) is None:
        return None
    sign = -1 if s.startswith("-") else 1
    s = s.lstrip("+-").replace(",", "")
    try:
        if " " in s:  # mixed number "1 1/2"
            whole, frac = s.split()
            num, den = frac.split("/")
            return sign * (int(whole) + Fraction(int(num), int(den)))
        if "/" in s:
            num, den = s.split("/")
            return sign * Fraction(Fraction(num), int(den))
        return sign * Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def decimal_places(text: str) -> int:
    """Digits after the decimal point of a written decimal (0 for integers and fractions)."""
    match = re.search(r"\.(\d+)", text)
    return len(match.group(1)) if match and "/" not in text else 0


def same_number(got: str, reference: str) -> bool:
    """Whether two written answers denote the same number (exact, or a k>=2-place rounding of a fraction)."""
    a, b = parse_number(got), parse_number(reference)
    if a is None or b is None:
        return False
    if a == b:
        return True
    for text, value, other in ((got, a, b), (reference, b, a)):
        places = decimal_places(text)
        if places >= 2 and other.denominator != 1 and round(other, places) == value:
            return True
    return False


def reference_answer(gsm8k_answer: str) -> str:
    """The final answer of a GSM8K reference solution: the text after its `####`."""
    head, sep, tail = gsm8k_answer.rpartition("####")
    if not sep or not tail.strip():
        raise ValueError("no '#### <answer>' at the end of the reference solution")
    return tail.strip()


def extract_answer(text: str) -> str | None:
    """The final answer a completion states, by the most explicit format present; None when it states none.

    Within the chosen format the first number is the answer (`#### 18 apples`
    -> `18`); a statement holding no number yields None.
    """
    for pattern in _PATTERNS:
        match = pattern.search(text)
        if match:
            stated = match.group(1)
            if parse_number(stated) is not None:
                return stated.strip()
            found = _NUMBER_RE.search(_FRAC_LATEX.sub(lambda m: f"{m.group(1)}/{m.group(2)}",
                                                      _CURRENCY.sub("", stated)))
            return found.group(0).strip() if found else None
    return None


def last_number(text: str) -> str | None:
    """The last number `text` writes (a chat reply's answer: "12 + 7 = 19.", "... so she has 19 apples"), or None
    when it writes none. LaTeX fractions and currency signs are read as `extract_answer` reads them."""
    found = _NUMBER_RE.findall(_FRAC_LATEX.sub(lambda m: f"{m.group(1)}/{m.group(2)}", _CURRENCY.sub("", text)))
    return found[-1].strip() if found else None
