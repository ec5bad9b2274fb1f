"""What tests/conftest.py gives the test processes and the processes they start: the default lane's child processes
compile without LLVM's optimisation passes, as the test processes do (they are compile-bound at these sizes); a
session that runs a calibrated lane's test (learning, realmodel, bench: bars set from runs outside pytest) keeps
its child processes compiling as users' processes do."""

import os

import pytest

from tests.conftest import CALIBRATED_LANES, TEST_PROCESS_XLA_FLAG, children_compile_unoptimised


def test_the_default_lanes_child_processes_get_the_compile_flag(request):
    selected = {mark.name for item in request.session.items for mark in item.iter_markers()}
    expected = not selected & set(CALIBRATED_LANES)
    assert (TEST_PROCESS_XLA_FLAG in os.environ.get("XLA_FLAGS", "").split()) == expected


@pytest.mark.parametrize("lane", CALIBRATED_LANES)
def test_a_session_with_a_calibrated_lanes_test_passes_no_flag_on(lane):
    assert not children_compile_unoptimised({"e2e", "slow", lane})
    assert children_compile_unoptimised({"e2e", "slow", "redis", "heavy", "chaos"})
