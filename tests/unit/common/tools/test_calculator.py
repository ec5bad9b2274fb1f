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
