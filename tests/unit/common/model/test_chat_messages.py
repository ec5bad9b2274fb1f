"""Messages as a chat template reads them (common/model/chat_messages.py), shared by the endpoint and the verifiers
task, and the bearer token of an HTTP request (common/rpc/auth.py)."""

import pytest

from grpo_stream.common.model.chat_messages import MessageError, template_messages
from grpo_stream.common.rpc.auth import bearer_value


def test_text_parts_are_joined():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template_messages(messages)[0]["content"] == "ab"


@pytest.mark.parametrize("text", [{"a": 1}, 3, ["x"]])
def test_a_text_part_whose_text_is_not_a_string_is_refused_naming_it(text):
    """It was rendered as its Python repr ("{'a': 1}") into the prompt."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": text}]}]
    with pytest.raises(MessageError, match=r"messages\[0\]\.content\[1\]\.text: a string"):
        template_messages(messages)


@pytest.mark.parametrize("messages, field", [
    ("What is 2+2?", r"row 0's prompt: a list of messages"),  # iterated per character: a TypeError naming nothing
    ([{"content": "hi"}], r"row 0's prompt\[0\]\.role"),  # a bare KeyError 'role'
    (["hi"], r"row 0's prompt\[0\]\.role"),
    ([{"role": None, "content": "hi"}], r"row 0's prompt\[0\]\.role"),  # passed on to the template as None
])
def test_a_prompt_that_is_not_a_list_of_messages_is_refused_naming_it(messages, field):
    """A verifiers dataset row's prompt reaches template_messages unchecked."""
    with pytest.raises(MessageError, match=field):
        template_messages(messages, "row 0's prompt")


@pytest.mark.parametrize("header", ["Bearer tok", "bearer tok", "BEARER  tok "])
def test_the_bearer_scheme_is_read_in_any_case(header):
    """RFC 7235: the scheme is case-insensitive; "bearer <token>" got a 401."""
    assert bearer_value(header) == "tok"


@pytest.mark.parametrize("header", [None, "", "Bearer ", "Bearer   ", "Basic dG9r", "Bearertok"])
def test_no_token_is_read_from_a_header_without_one(header):
    assert bearer_value(header) is None
