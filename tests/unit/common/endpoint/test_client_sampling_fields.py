"""What evaluation and RL clients send the endpoint beside their prompt.

Clients pin every sampling control at vLLM's neutral value (verifiers' renderer client and many harnesses send
`repetition_penalty: 1`, `top_k: 0`, `min_p: 0`; vLLM's own default is top_k 0); the endpoint refused them as if
they changed the sampling, and told the client to send `repetition_penalty: 0`, which vLLM refuses. lm-eval sends a
task's `until` strings and the EOS text as `stop` (aime: 5, humaneval: 6), and vLLM takes any number: OpenAI's limit
of 4 refused those tasks outright.
"""

import json

import pytest

from grpo_stream.common.endpoint.app import _validated
from grpo_stream.common.endpoint.protocol import MAX_STOPS, ChatRequest, CompletionRequest, RequestError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
HUMANEVAL_STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|im_end|>"]  # its `until` and the EOS text


@pytest.mark.parametrize("neutral", [
    {"repetition_penalty": 1.0}, {"repetition_penalty": 1}, {"top_k": 0}, {"top_k": -1}, {"min_p": 0.0},
    {"presence_penalty": 0.0, "frequency_penalty": 0}, {"logit_bias": {}}, {"response_format": {"type": "text"}},
    {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
     "top_p": 1.0, "logit_bias": {}},
])
def test_sampling_controls_at_vllms_neutral_values_are_served(neutral):
    ChatRequest.model_validate({**CHAT, **neutral}).check()
    CompletionRequest.model_validate({"model": "m", "prompt": "hi", **neutral}).check()


@pytest.mark.parametrize("changed, field", [
    ({"repetition_penalty": 1.1}, "repetition_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"top_k": 20}, "top_k"), ({"min_p": 0.05}, "min_p"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"guided_regex": "a+"}, "guided_regex"),
])
def test_a_control_that_would_change_the_sampling_is_refused_naming_it_and_its_neutral_value(changed, field):
    with pytest.raises(RequestError) as refused:
        ChatRequest.model_validate({**CHAT, **changed}).check()
    message = str(refused.value)
    assert message.startswith(f"{field}=") and "not served" in message
    if field == "repetition_penalty":
        assert "or 1" in message and "or 0" not in message  # the value that changes nothing, not one vLLM refuses


def test_lm_evals_stop_strings_are_taken_and_a_flood_of_them_is_refused():
    request = _validated(CompletionRequest, json.dumps({"model": "m", "prompt": "def f():",
                                                        "stop": HUMANEVAL_STOPS}).encode())
    assert isinstance(request, CompletionRequest) and request.stop == HUMANEVAL_STOPS
    refused = _validated(ChatRequest, json.dumps({**CHAT, "stop": ["s"] * (MAX_STOPS + 1)}).encode())
    assert refused.status_code == 400 and json.loads(refused.body)["error"]["param"] == "stop"
