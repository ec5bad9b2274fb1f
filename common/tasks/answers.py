"""Final answers of math word problems: find them in text, normalise them, compare them.

GSM8K references end in `#### N`; models answer in whatever format the prompt
template asked for (`#### N`, `<answer>N</answer>` as in the Tunix GSM8K demo,
`\\boxed{N}`, "the answer is N"). A number is compared as an exact rational,
after removing what people write around numbers:

- thousands separators (`1,234`, `1 234`, `1_234`, LaTeX's `1{,}234`, `1\\,234`), a
  leading `+`, the Unicode minus (also where a number is searched for in
  text), a LaTeX `\\$`, a space between a stated answer's sign and its
  number (`#### - 3` is -3);
- currency signs and codes before or after (`$`, `€`, `£`, `¥`, `USD`), units
  of percent (`50%` equals `50`: GSM8K states percentages as bare numbers);
- trailing zeros and points (`10.50` = `10.5`, `7.` = `7`, `3.0` = `3`);
- fractions and mixed numbers (`3/4` = `0.75`, `1 1/2` = `1.5`, LaTeX
  `\\frac{3}{4}`, `\\tfrac{3}{4}`, `\\frac34`, `2\\frac{1}{2}` = `2.5`).

A `####` line that is a markdown heading (`#### Step 1`, and numbered ones:
`#### 1. Eggs left`, `#### 2) Money`) states no answer.

A `-` or `+` right after a letter or digit joins words or numbers
(`3-4`, `2023-05-01`, `x-3`): it is no sign, so `3-4` holds 3 and 4, never -4.

A reasoning model's thinking is no answer: only the reply after its last `</think>` is read (base.reply).

A decimal written with k >= 2 places also matches a fraction that rounds to
it (`0.33` matches `1/3`), since a model cannot write 1/3 as a decimal exactly;
only a value with no exact decimal is matched so (`1.00` is not `1.004`).
"""

from __future__ import annotations

import re
from fractions import Fraction

from grpo_stream.common.tasks.base import reply

_CURRENCY = re.compile(r"(?i)(?:us\$|\$|€|£|¥|₹|usd|eur|gbp|dollars?|cents?)")
# `\\frac{3}{4}`, `\\dfrac`, `\\tfrac`, spaced (`\\frac {3} {4}`), and TeX's one-digit arguments (`\\frac12` is 1/2)
_FRAC_LATEX = re.compile(r"\\[dt]?frac\s*(?:\{([^{}]+)\}|(\d))\s*(?:\{([^{}]+)\}|(\d))")
# LaTeX's spaces between digit groups (`1\\,000`, `1\\!000`, `1\\ 000`): a thousands separator
_LATEX_THOUSANDS = re.compile(r"(?<=\d)\\[,! ](?=\d{3}(?!\d))")
_SIGN = r"(?:(?<![^\W_])[-+])?"  # a sign, unless a letter or digit comes right before it (`3-4`, `x-3`)
_NUMBER = rf"{_SIGN}(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d*)?(?:\s+\d+/\d+|/\d+)?|{_SIGN}\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
# `#### N` (GSM8K's format): a number follows, perhaps in bold (`#### **18**`); `#### Step 1` is a markdown heading
_HASHES = re.compile(r"####[ \t]*(?:\*\*[ \t]*)?((?=[-+$€£¥₹.\d\\\u2212])[^\n]*)")
# ... and `#### 1. Eggs left`, `#### 2) Money`, `#### 3: Total` are numbered markdown headings, not answers
_NUMBERED_HEADING = re.compile(r"\d+[.):][ \t]+\**[^\W\d_]")
# a sign the model spaced from its number (`#### - 3`, `<answer>- $5</answer>`): the statement's number is negative
_SPACED_SIGN = re.compile(r"^\s*([-+])[ \t]+(?=[$€£¥₹]?\.?\d)")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_IS = re.compile(r"(?i)the (?:final )?answer is([:\s]*)([^\n]*)")
_BULLET = re.compile(r"[-*+][ \t]+")  # "The answer is:\n- 18 eggs": a list item, no minus sign
_OPEN, _CLOSE = "<answer>", "</answer>"


def _answer_tags(text: str):
    """What each `<answer>...</answer>` holds, whitespace stripped, in order: what `<answer>\\s*(.*?)\\s*</answer>`
    finds, in linear time (that pattern tries every `<answer>` against the rest of the text when none is closed:
    quadratic, 43 s on 128k characters of `<answer>` repeated)."""
    start = 0
    while (opened := text.find(_OPEN, start)) >= 0:
        closed = text.find(_CLOSE, opened + len(_OPEN))
        if closed < 0:
            return  # no later `<answer>` is closed either
        yield text[opened + len(_OPEN):closed].strip()  # str.strip and the pattern's \s: the same whitespace
        start = closed + len(_CLOSE)


def _groups(pattern: re.Pattern):
    return lambda text: (match.group(1) for match in pattern.finditer(text))


def _hashes(text: str):
    """What each `#### N` states, in order; numbered markdown headings (`#### 1. Eggs left`) passed over: read as
    answers, a reply's first heading was its answer (1) whatever it concluded, and earned answer_format's credit."""
    return (stated for stated in _groups(_HASHES)(text) if _NUMBERED_HEADING.match(stated) is None)


def _answer_is(text: str):
    """What each "the answer is ..." states, in order; a list item's bullet on the next line dropped."""
    for match in _ANSWER_IS.finditer(text):
        stated, bullet = match.group(2), _BULLET.match(match.group(2))
        yield stated[bullet.end():] if bullet and "\n" in match.group(1) else stated


_FORMATS = (_answer_tags, _hashes, _groups(_BOXED), _answer_is)  # most explicit first


def _plain(text: str) -> str:
    """`text` with the characters people write for ASCII ones in numbers made ASCII: the Unicode minus (which the
    number patterns would skip, flipping a sign), thin and no-break spaces, LaTeX's escaped dollar and its thousands
    separators `{,}` and `\\,` (which `last_number` would otherwise split, reading `1{,}080` as 80)."""
    text = _LATEX_THOUSANDS.sub(",", text)
    for written, ascii_ in (("\u2212", "-"), ("\u2009", " "), ("\u202f", " "), ("\u00a0", " "), ("\\$", "$"),
                            ("{,}", ",")):
        text = text.replace(written, ascii_)
    return text


def _searchable(text: str) -> str:
    """`text` made plain, LaTeX fractions written a/b and currency signs and codes removed: what the number
    patterns read."""
    return _CURRENCY.sub("", _FRAC_LATEX.sub(_latex_fraction, _plain(text)))


def _latex_fraction(match: re.Match) -> str:
    """A LaTeX fraction written a/b; after a digit, the fraction of a mixed number (`2\\frac{1}{2}` is `2 1/2`: read
    as `21/2`, it was 10.5)."""
    numerator, denominator = match.group(1) or match.group(2), match.group(3) or match.group(4)
    whole = match.string[match.start() - 1:match.start()].isdigit()
    return f"{' ' if whole else ''}{numerator}/{denominator}"


def parse_number(text: str) -> Fraction | None:
    """The exact value of one written number (see the module docstring), or None if `text` is not one."""
    s = _SPACED_SIGN.sub(r"\1", _searchable(text.strip().replace("_", "")).strip()).rstrip(".,;:!").strip()
    if s.endswith("%"):
        s = s[:-1].strip()
    s = re.sub(r"(?<=\d) (?=\d{3}\b(?!/))", "", s)  # "1 234" -> "1234", but "2 100/200" is a mixed number
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
    """Whether two written answers denote the same number (exact, or a k>=2-place rounding of a value that has no
    exact decimal)."""
    a, b = parse_number(got), parse_number(reference)
    if a is None or b is None:
        return False
    if a == b:
        return True
    for text, value, other in ((got, a, b), (reference, b, a)):
        places = decimal_places(text)
        if places >= 2 and not _exact_decimal(other) and round(other, places) == value:
            return True
    return False


def _exact_decimal(value: Fraction) -> bool:
    """Whether `value` has a finite decimal expansion (its denominator has no prime factor but 2 and 5): such a value
    is written exactly, so a rounding of it is a different answer."""
    den = value.denominator
    for prime in (2, 5):
        while den % prime == 0:
            den //= prime
    return den == 1


def reference_answer(gsm8k_answer: str) -> str:
    """The final answer of a GSM8K reference solution: the text after its `####`."""
    head, sep, tail = gsm8k_answer.rpartition("####")
    if not sep or not tail.strip():
        raise ValueError("no '#### <answer>' at the end of the reference solution")
    return tail.strip()


def extract_answer(text: str) -> str | None:
    """The final answer a completion states, by the most explicit format present; None when it states none.

    Within a format the first statement holding a number is the answer, and its first number (`#### 18 apples` ->
    `18`); a statement holding none (`<answer> and </answer>` restating the requested format) is passed over. A
    reasoning model's thinking is not read (base.reply): its drafts came first, and the first statement won.
    """
    text = reply(text)
    return next((number for statements in _FORMATS if (number := _stated(statements, text)) is not None), None)


def hashes_answer(text: str) -> str | None:
    """The number a completion's reply (base.reply) states as `#### N` (GSM8K's format; markdown headings passed
    over), or None."""
    return _stated(_hashes, reply(text))


def _stated(statements, text: str) -> str | None:
    """The number of the first of `statements(text)` (one format's statements, in order) holding one, or None."""
    for stated in statements(text):
        number = _number_in(stated)
        if number is not None:
            return number
    return None


def _number_in(stated: str) -> str | None:
    """`stated` when it is one number, else the first number written in it, else None."""
    stated = _plain(stated)
    if parse_number(stated) is not None:
        return stated.strip()
    found = _NUMBER_RE.search(_SPACED_SIGN.sub(r"\1", _searchable(stated)))
    return found.group(0).strip() if found else None


def last_number(text: str) -> str | None:
    """The last number `text` writes (a chat reply's answer: "12 + 7 = 19.", "... so she has 19 apples"), or None
    when it writes none. LaTeX fractions and currency signs are read as `extract_answer` reads them, and a reasoning
    model's thinking is not (base.reply: a reply with no number has none, whatever the thinking computed)."""
    found = _NUMBER_RE.findall(_searchable(reply(text)))
    return found[-1].strip() if found else None
