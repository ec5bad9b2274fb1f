"""CI sets $GRPO_STREAM_REQUIRE_GSM8K=1: without the GSM8K data its tests must fail, not skip, so a missing data set
cannot silently drop coverage (elsewhere they skip)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("require, outcome", [("1", "6 errors"), ("0", "6 skipped")])
def test_gsm8k_tests_fail_in_ci_and_skip_elsewhere_without_the_data(tmp_path, require, outcome):
    env = {**os.environ, "GRPO_STREAM_GSM8K_DIR": str(tmp_path / "missing"), "GRPO_STREAM_REQUIRE_GSM8K": require}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "tests/unit/common/tasks/test_gsm8k.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == (1 if require == "1" else 0), proc.stdout[-2000:]
    assert outcome in proc.stdout and f"GSM8K not found at {tmp_path / 'missing'}" in proc.stdout, proc.stdout[-2000:]
