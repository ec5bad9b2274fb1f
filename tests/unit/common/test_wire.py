import grpc
import numpy as np

from common.wire import CompletionData, GroupData, GroupLimits, decode_group, encode_group, to_proto, validate_group

LIMITS = GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=6, vocab_size=50)


def make_group(**kw) -> GroupData:
    comps = [CompletionData(np.array([3, 4, 5], np.int32), np.array([-0.5, -1.0, -0.25], np.float32), 1.0, False,
                            {"answer_correct": 1.0}),
             CompletionData(np.array([7], np.int32), np.array([-2.0], np.float32), 0.0, True, {})]
    base = dict(group_id="r/s0/1", prompt_id="p1", prompt_token_ids=np.array([1, 2, 9], np.int32), completions=comps,
                policy_version=3, sampler_id="sampler-0", created_unix=12.5, reference_answer="42")
    base.update(kw)
    return GroupData(**base)


def test_roundtrip_preserves_every_field():
    g = make_group()
    back = decode_group(encode_group(g))
    assert back.group_id == g.group_id and back.prompt_id == g.prompt_id and back.policy_version == 3
    assert back.sampler_id == "sampler-0" and back.reference_answer == "42" and back.created_unix == 12.5
    np.testing.assert_array_equal(back.prompt_token_ids, g.prompt_token_ids)
    for a, b in zip(back.completions, g.completions):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.reward == b.reward and a.truncated == b.truncated and a.reward_components == b.reward_components


def test_token_fields_are_packed():
    # packed int32: tag + length + 1 byte per small id, not a tag per element
    msg = to_proto(make_group(prompt_token_ids=np.arange(1, 101, dtype=np.int32) % 50))
    size_100 = len(msg.SerializeToString())
    msg2 = to_proto(make_group(prompt_token_ids=np.arange(1, 201, dtype=np.int32) % 50))
    assert len(msg2.SerializeToString()) - size_100 <= 101


def test_valid_group_has_no_errors():
    assert validate_group(to_proto(make_group()), LIMITS) == []


def test_token_logprob_length_mismatch_names_field():
    msg = to_proto(make_group())
    del msg.completions[1].logprobs[:]
    msg.completions[1].logprobs.extend([-1.0, -1.0])
    errors = validate_group(msg, LIMITS)
    assert errors == ["completions[1].logprobs: 2 values for 1 token_ids; send one logprob per token"]


def test_limits_are_named():
    msg = to_proto(make_group(prompt_token_ids=np.arange(1, 11, dtype=np.int32), policy_version=-1))
    msg.completions[0].logprobs[0] = 0.5
    msg.completions.pop()
    text = " | ".join(validate_group(msg, LIMITS))
    assert "prompt_token_ids: 10 tokens, must be 1..8 (generation.max_prompt_tokens)" in text
    assert "policy_version: -1 is negative" in text
    assert "completions: 1 given, generation.num_generations=2" in text
    assert "completions[0].logprobs: must be finite and <= 0" in text


def test_out_of_vocab_and_empty_ids():
    msg = to_proto(make_group(group_id=""))
    msg.completions[0].token_ids[0] = 50
    text = " | ".join(validate_group(msg, LIMITS))
    assert "group_id: must not be empty" in text and "completions[0].token_ids: ids must be in [0, 50)" in text


def test_status_code_values_match_grpc():
    assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] == 8
