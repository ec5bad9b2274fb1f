"""What tests/conftest.py gives the test processes, and keeps from the processes they start: those inherit this
environment and compile as users' processes do, so e2e runs and learning checks (calibrated on runs outside pytest)
see the programs users get."""

import os

from tests.conftest import TEST_PROCESS_XLA_FLAG


def test_the_test_processes_compile_flag_is_not_passed_on():
    assert TEST_PROCESS_XLA_FLAG not in os.environ.get("XLA_FLAGS", "")
