"""The calculator's answers to results a float cannot hold exactly (tests/unit/common/environments/
test_gsm8k_tools.py checks the rest of it)."""

import pytest

from grpo_stream.common.tools.calculator import calculator


@pytest.mark.parametrize("expression, expected", [
    ("(10 ** 64) ** 0.5", "1e+32"),  # was 100000000000000005366162204393472: noise digits read as exact
    ("10 ** 64 // 3 ** 0.5", "5.7735026919e+63"), ("0.1 * 3 * 1e17", "3e+16"), ("-1e20 / 1", "-1e+20"),
    ("2 ** 53 * 1.0", "9007199254740992"), ("10 ** 20", "100000000000000000000"), ("48 / 4", "12")])
def test_a_large_float_is_not_written_as_an_exact_integer(expression, expected):
    """Integers a float holds exactly (up to 2**53) are written as integers; a larger integral float is written
    with its 12 significant digits, as other floats are; integer arithmetic stays exact."""
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, exponent", [("2 ** 10 ** 10", "10000000000"), ("2 ** -1074", "-1074"),
                                                  ("2 ** 65.5", "65.5")])
def test_an_exponent_out_of_bounds_is_named_with_the_bounds(expression, exponent):
    """A negative exponent was said to be "larger than 64"."""
    assert calculator(expression).startswith(f"error: exponent {exponent} is outside -64..64; use numbers")


@pytest.mark.parametrize("expression, expected", [
    ("987654321 * 1234.5", "1219259259274.5"),  # was 1219259259270.0: off by 4.5 and written as if exact
    ("123456789012.34 + 0", "123456789012.34"),  # was 123456789012.0: the cents dropped
    ("1e11 + 0.25", "100000000000.25"), ("(0.1 + 0.2) * 1e12", "300000000000"),
    ("1234567890123456.5 * 1", "1.23456789012346e+15")])  # past the 15 digits a float holds: not written as exact
def test_a_large_answer_keeps_its_integer_digits_and_cents(expression, expected):
    """A non-integral answer of more than 10 integer digits was rounded to 12 significant digits and written back as
    a float, with zeros standing for the digits dropped: the model read a wrong answer as an exact one."""
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, expected", [(" 3 + 4", "7"), ("\t48 / 2 ", "24"), ("\n 2 ** 3", "8")])
def test_whitespace_around_the_expression_is_allowed(expression, expected):
    """A leading space (as models write `{"expression": " 3 + 4"}`) was answered "unexpected indent"."""
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, named", [("2 ^ 3", "^ is not allowed; a power is written **"),
                                               ("6 & 3", "& is not allowed"), ("1 << 3", "<< is not allowed"),
                                               ("~5", "~ is not allowed"), ("not 1", "not is not allowed")])
def test_an_operator_not_allowed_is_named(expression, named):
    """`2 ^ 3` (a power as many write it) was answered "BinOp is not allowed", which names no operator to change."""
    answer = calculator(expression)
    assert answer.startswith("error:") and named in answer


@pytest.mark.parametrize("expression", ["(1e300) ** 2", "1e200 ** 2 * 1", "(10 ** 64) ** 5 / 1 * 1e300"])
def test_a_float_overflow_says_the_result_is_too_large(expression):
    """`(1e300) ** 2` was answered with the C library's "(34, 'Numerical result out of range')"."""
    assert calculator(expression).startswith("error: the result is too large")


def test_a_huge_exponent_is_named_by_its_size_not_its_digits():
    """`2 ** ((2**64)**63)` (17 characters) was answered with the exponent's 1,214 digits: an error that filled the
    episode's token budget instead of saying what to change."""
    answer = calculator("2 ** ((2**64)**63)")
    assert answer.startswith("error: exponent of 1214 digits is outside -64..64; use numbers"), answer[:120]
    assert len(answer) < 200
