"""What the vLLM engine refuses before vLLM sees a request (base.check_served with its CONTEXT_FIELD, no vLLM
needed): what the JAX engine refuses (request_rows.RequestRows.register), each with an error naming the setting. The
refusals inside a running vLLM engine: test_vllm_refusals.py."""

import pytest

from grpo_stream.common.engine.base import Request, check_served
from grpo_stream.common.engine.vllm_requests import CONTEXT_FIELD

VOCAB, BUDGET, CONTEXT = 160, 8, 32


def _check(ids, budget=BUDGET):
    return check_served(Request(list(ids), budget, 0), BUDGET, CONTEXT, VOCAB, CONTEXT_FIELD)


@pytest.mark.parametrize("ids", [[5, VOCAB], [VOCAB + 31], [-1, 5]])
def test_ids_outside_the_models_vocabulary_are_refused(ids):
    # vLLM without a tokenizer checks none: an id inside the embedding's padded rows decodes silently, one past them
    # fails the engine's step (on GPU a device-side assert that ends the process)
    with pytest.raises(ValueError, match=rf"token ids must lie in 0\.\.{VOCAB - 1}, the model's vocabulary"):
        _check(ids)


@pytest.mark.parametrize("budget", [0, -1, BUDGET + 1])
def test_a_budget_outside_one_to_max_new_tokens_is_refused_naming_the_setting(budget):
    with pytest.raises(ValueError, match=rf"budget of {budget} new tokens is outside 1\.\.{BUDGET} "
                                         r"\(generation\.max_new_tokens\)"):
        _check([5, 6], budget)


def test_an_empty_prompt_is_refused_as_empty_not_as_too_long():
    with pytest.raises(ValueError, match="has no prompt tokens"):
        _check([])


def test_prompt_and_budget_past_the_context_are_refused_naming_the_settings():
    with pytest.raises(ValueError, match=r"25 prompt tokens and a budget of 8 does not fit the engine's 32 tokens "
                                         r"\(generation\.max_prompt_tokens \+ generation\.max_new_tokens"):
        _check([1] * 25)


def test_a_request_at_every_edge_passes():
    request = Request([0] * (CONTEXT - BUDGET) + [VOCAB - 1], BUDGET - 1, 0)
    assert check_served(request, BUDGET, CONTEXT, VOCAB, CONTEXT_FIELD) is request
