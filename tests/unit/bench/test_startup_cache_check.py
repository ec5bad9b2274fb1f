"""`bench startup`'s check of what the compilation cache did: a warm run that reached shapes its cold run had not
is fine; one that compiled a cached program again, or loaded nothing, is an error."""

import pytest

from grpo_stream.bench.startup import check_cache

COLD = {"seconds": 5.62, "programs": 28, "loaded": 0, "written": 28, "entries": 28}


def test_a_warm_run_may_compile_programs_its_cold_run_never_reached():
    # measured: a warm run on a loaded machine (2026-11-29) that went 3 programs further than its cold run
    check_cache({"cold": [COLD], "warm": [{"seconds": 2.77, "programs": 31, "loaded": 28, "written": 3,
                                           "entries": 31}]})


@pytest.mark.parametrize("warm", [
    {"programs": 28, "loaded": 25, "written": 3, "entries": 28},  # rewrote 3 cached programs
    {"programs": 28, "loaded": 0, "written": 28, "entries": 56},  # keys that never match: loaded nothing
], ids=["compiled-again", "loaded-nothing"])
def test_a_warm_run_that_compiles_cached_programs_again_is_an_error(warm):
    with pytest.raises(RuntimeError, match="warm run did not load"):
        check_cache({"cold": [COLD], "warm": [{"seconds": 3.0, **warm}]})


def test_a_cold_run_that_loads_is_an_error():
    with pytest.raises(RuntimeError, match="cold run loaded"):
        check_cache({"cold": [{**COLD, "loaded": 2}], "warm": [COLD]})
