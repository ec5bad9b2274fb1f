import grpc
import numpy as np
import pytest

from grpo_stream.common.rollouts.wire import (MAX_ABS_REWARD, MAX_COMPONENT_NAME_CHARS, MAX_DATA_POSITION,
                                              MAX_REWARD_COMPONENTS, CompletionData, GroupData, GroupLimits,
                                              decode_group, decode_trainable_group, encode_group, model_mask_of,
                                              to_proto, validate_group)

LIMITS = GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=6, vocab_size=50)


def make_group(**kw) -> GroupData:
    comps = [CompletionData(np.array([3, 4, 5], np.int32), np.array([-0.5, -1.0, -0.25], np.float32), 1.0, False,
                            {"answer_correct": 1.0}),
             CompletionData(np.array([7], np.int32), np.array([-2.0], np.float32), 0.0, True, {})]
    base = dict(group_id="r/s0/1", prompt_id="p1", prompt_token_ids=np.array([1, 2, 9], np.int32), completions=comps,
                policy_version=3, sampler_id="sampler-0", created_unix=12.5, reference_answer="42", data_position=1)
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


def test_completion_arrays_are_raw_little_endian_bytes():
    msg = to_proto(make_group())
    assert msg.completions[0].token_ids_le == np.array([3, 4, 5], "<i4").tobytes()
    assert msg.completions[0].logprobs_le == np.array([-0.5, -1.0, -0.25], "<f4").tobytes()
    # 8 bytes per completion token plus small per-field overhead
    long = make_group(completions=[CompletionData(np.arange(512, dtype=np.int32), -np.ones(512, np.float32), 0.0,
                                                  False)])
    assert 8 * 512 <= len(encode_group(long)) <= 8 * 512 + 100


def test_bytes_not_a_whole_number_of_values_is_named():
    msg = to_proto(make_group())
    msg.completions[0].token_ids_le += b"\x01"
    msg.completions[1].logprobs_le = msg.completions[1].logprobs_le[:-2]
    errors = validate_group(msg, LIMITS)
    assert errors[0].startswith("completions[0].token_ids_le: 13 bytes is not a whole number of 4-byte values")
    assert errors[1].startswith("completions[1].logprobs_le: 2 bytes is not a whole number")


def test_decoded_arrays_are_int32_and_float32():
    back = decode_group(encode_group(make_group()))
    assert back.completions[0].token_ids.dtype == np.int32 and back.completions[0].logprobs.dtype == np.float32


def test_valid_group_has_no_errors():
    assert validate_group(to_proto(make_group()), LIMITS) == []


def test_a_dataset_group_needs_its_data_position_and_an_injected_one_does_not():
    """After compaction trims the accepted-ids record, a resent copy is refused by its sampler's data position alone:
    a group without one could be trained twice (and the audit could not tell)."""
    errors = validate_group(to_proto(make_group(data_position=None)), LIMITS)
    assert errors == ["data_position: required for a group drawn from a sampler's data stream (its index there; "
                      "groups answering injected prompts set injected=true instead)"]
    assert validate_group(to_proto(make_group(data_position=None, injected=True)), LIMITS) == []


def test_a_data_position_the_buffer_cannot_record_exactly_is_refused_naming_the_field():
    """The buffer's scripts keep positions as Lua doubles written by cjson (14 significant digits): 10**14 would be
    recorded as 1e+14, a record compaction reads as damaged (it then holds back for the rest of the run)."""
    assert validate_group(to_proto(make_group(data_position=MAX_DATA_POSITION)), LIMITS) == []
    for position in (MAX_DATA_POSITION + 1, 10**17):
        errors = validate_group(to_proto(make_group(data_position=position)), LIMITS)
        assert errors == [f"data_position: {position} is above {MAX_DATA_POSITION}, the highest the buffer records "
                          "exactly; a sampler numbers its data stream's prompts from 0"]


def test_token_logprob_length_mismatch_names_field():
    msg = to_proto(make_group())
    msg.completions[1].logprobs_le = np.array([-1.0, -1.0], "<f4").tobytes()
    errors = validate_group(msg, LIMITS)
    assert errors == ["completions[1].logprobs_le: 2 values for 1 token ids; send one logprob per token"]


def test_limits_are_named():
    msg = to_proto(make_group(prompt_token_ids=np.arange(1, 11, dtype=np.int32), policy_version=-1))
    msg.completions[0].logprobs_le = np.array([0.5, -1.0, -0.25], "<f4").tobytes()
    msg.completions.pop()
    text = " | ".join(validate_group(msg, LIMITS))
    assert "prompt_token_ids: 10 tokens, must be 1..8 (generation.max_prompt_tokens)" in text
    assert "policy_version: -1 is negative" in text
    assert "completions: 1 given, generation.num_generations=2" in text
    assert "completions[0].logprobs_le: must be finite and <= 0" in text


def test_out_of_vocab_and_empty_ids():
    msg = to_proto(make_group(group_id=""))
    msg.completions[1].token_ids_le = np.array([50], "<i4").tobytes()
    msg.completions[0].logprobs_le = np.array([-0.5, np.nan, -0.25], "<f4").tobytes()
    errors = validate_group(msg, LIMITS)
    assert errors == ["group_id: must not be empty", "completions[1].token_ids_le: ids must be in [0, 50)",
                      "completions[0].logprobs_le: must be finite and <= 0"]


def test_a_reward_past_the_bound_is_refused_naming_the_field():
    """A finite float32 reward near 3e38 overflowed drgrpo's and rloo's float32 advantages into inf (then NaN
    parameters); anything past +-MAX_ABS_REWARD, or not finite, is refused."""
    at_bound = make_group()
    at_bound.completions[0].reward, at_bound.completions[1].reward = MAX_ABS_REWARD, -MAX_ABS_REWARD
    assert validate_group(to_proto(at_bound), LIMITS) == []
    for reward in (3e38, -2 * MAX_ABS_REWARD, float("nan"), float("inf")):
        group = make_group()
        group.completions[1].reward = reward
        errors = validate_group(to_proto(group), LIMITS)
        assert len(errors) == 1 and errors[0].startswith("completions[1].reward: ")
        assert f"must be finite and within +-{MAX_ABS_REWARD:g}" in errors[0]


def test_reward_components_must_be_finite():
    """A NaN or infinite component became a NaN train/reward/<name> series (null in the JSONL file)."""
    group = make_group()
    group.completions[0].reward_components = {"answer_correct": 1.0, "length": float("nan"), "x": float("-inf")}
    group.completions[1].reward_components = {"ok": 0.5}
    assert validate_group(to_proto(group), LIMITS) == [
        "completions[0].reward_components['length']: nan must be finite (and 1 more)"]


def test_reward_component_names_are_bounded_in_number_and_length():
    """Each name is a metric series in the trainer: a sender was free to send any number of any length."""
    def errors_for(components: dict) -> list[str]:
        group = make_group()
        group.completions[1].reward_components = components
        return validate_group(to_proto(group), LIMITS)

    assert errors_for({f"c{i}": 0.0 for i in range(MAX_REWARD_COMPONENTS)}) == []
    assert errors_for({f"c{i}": 0.0 for i in range(10_000)}) == [
        f"completions[1].reward_components: 10000 names, limit {MAX_REWARD_COMPONENTS} (each is a metric series in "
        "the trainer)"]
    assert errors_for({"n" * MAX_COMPONENT_NAME_CHARS: 1.0}) == []
    for name in ("n" * (MAX_COMPONENT_NAME_CHARS + 1), ""):
        assert errors_for({"fine": 1.0, name: 1.0}) == [
            f"completions[1].reward_components: a name of {len(name)} characters; names must be "
            f"1..{MAX_COMPONENT_NAME_CHARS} characters"]


def test_status_code_values_match_grpc():
    assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] == 8


def test_per_token_versions_travel_run_length_encoded():
    """In-flight weight updates: each token's version crosses the wire as runs; one version throughout is said
    once (the group's policy_version, its oldest) and costs no bytes per completion."""
    mixed = CompletionData(np.array([3, 4, 5, 6, 7], np.int32), -np.ones(5, np.float32), 1.0, False,
                           versions=np.array([3, 3, 4, 4, 6]))
    same = CompletionData(np.array([8, 9], np.int32), -np.ones(2, np.float32), 0.0, True, versions=np.array([3, 3]))
    msg = to_proto(make_group(completions=[mixed, same]))
    assert list(msg.completions[0].version_runs) == [3, 4, 6]
    assert list(msg.completions[0].version_run_lengths) == [2, 2, 1]
    assert not msg.completions[1].version_runs
    assert validate_group(msg, LIMITS) == []
    back = decode_group(msg.SerializeToString())
    assert back.completions[0].versions.tolist() == [3, 3, 4, 4, 6] and back.completions[1].versions is None


def test_bad_version_runs_are_named():
    msg = to_proto(make_group())
    c = msg.completions[0]  # 3 tokens, group policy_version 3
    c.version_runs[:] = [3, 4]
    c.version_run_lengths[:] = [1]
    assert any("completions[0].version_run_lengths: 1 lengths for 2" in e for e in validate_group(msg, LIMITS))
    c.version_run_lengths[:] = [1, 1]
    assert any("sum to the 3 tokens" in e for e in validate_group(msg, LIMITS))
    c.version_runs[:] = [2, 4]
    c.version_run_lengths[:] = [1, 2]
    assert any("completions[0].version_runs: must be non-decreasing and >= the group's policy_version 3" in e
               for e in validate_group(msg, LIMITS))
    c.version_runs[:] = [5, 4]
    assert any("non-decreasing" in e for e in validate_group(msg, LIMITS))


# -- multi-turn completions: model_token_mask ---------------------------------------------------------------------

def multi_turn(mask=(1, 1, 0, 0, 1), logprobs=(-0.5, -1.0, 0.0, 0.0, -0.25)) -> CompletionData:
    """A model turn of 2 tokens, 2 observation tokens the environment wrote, a model turn of 1."""
    return CompletionData(np.array([3, 4, 30, 31, 5], np.int32), np.array(logprobs, np.float32), 1.0, False,
                          model_mask=np.array(mask, np.bool_))


def test_model_token_mask_round_trips():
    single = CompletionData(np.array([7], np.int32), np.array([-2.0], np.float32), 0.0, True)
    msg = to_proto(make_group(completions=[multi_turn(), single]))
    assert msg.completions[0].model_token_mask == bytes([1, 1, 0, 0, 1]) and not msg.completions[1].model_token_mask
    assert validate_group(msg, LIMITS) == []
    back = decode_group(msg.SerializeToString())
    assert back.completions[0].model_mask.dtype == np.bool_
    assert back.completions[0].model_mask.tolist() == [True, True, False, False, True]
    assert back.completions[1].model_mask is None
    assert back.completions[0].model_tokens().tolist() == [True, True, False, False, True]
    assert back.completions[1].model_tokens().tolist() == [True]
    assert model_mask_of(msg.completions[0]).tolist() == [True, True, False, False, True]
    assert model_mask_of(msg.completions[1]) is None


def test_an_all_model_mask_sends_no_bytes():
    """Every token the model's (a single-turn completion that says so): the message is the one without a mask."""
    ones = CompletionData(np.array([3, 4, 5], np.int32), np.array([-0.5, -1.0, -0.25], np.float32), 1.0, False,
                          {"answer_correct": 1.0}, model_mask=np.ones(3, np.bool_))
    with_mask = make_group(completions=[ones, make_group().completions[1]])
    assert encode_group(with_mask) == encode_group(make_group())
    assert not to_proto(with_mask).completions[0].model_token_mask
    assert decode_group(encode_group(with_mask)).completions[0].model_mask is None


def test_model_token_mask_length_must_match_the_tokens():
    msg = to_proto(make_group(completions=[multi_turn(), make_group().completions[1]]))
    msg.completions[0].model_token_mask = bytes([1, 0, 1])
    assert validate_group(msg, LIMITS) == [
        "completions[0].model_token_mask: 3 bytes for 5 tokens; send one byte per token (1 = the model sampled it, "
        "0 = an observation), or none when every token is the model's"]


def mask_errors(mask, logprobs=(-0.5, -1.0, 0.0, 0.0, -0.25)) -> list[str]:
    msg = to_proto(make_group(completions=[make_group().completions[1], multi_turn()]))
    msg.completions[1].model_token_mask = bytes(mask)
    msg.completions[1].logprobs_le = np.array(logprobs, "<f4").tobytes()
    return validate_group(msg, LIMITS)


def test_model_token_mask_values_are_zero_or_one():
    assert mask_errors([1, 1, 0, 2, 1]) == [
        "completions[1].model_token_mask: values must be 0 (an observation token) or 1 (a token the model sampled)"]


def test_the_first_token_is_the_models():
    assert mask_errors([0, 1, 0, 0, 1], logprobs=(0.0, -1.0, 0.0, 0.0, -0.25)) == [
        "completions[1].model_token_mask: the first token is an observation; a completion starts with the model's "
        "turn (what the environment wrote before it belongs in the prompt)"]


def test_a_completion_has_a_model_token():
    assert mask_errors([0, 0, 0, 0, 0], logprobs=(0.0,) * 5) == [
        "completions[1].model_token_mask: no token is the model's; a completion holds at least one token the model "
        "sampled (mark it 1)"]


def test_observation_tokens_carry_logprob_zero():
    assert mask_errors([1, 1, 0, 0, 1], logprobs=(-0.5, -1.0, -0.1, 0.0, -0.25)) == [
        "completions[1].logprobs_le: observation tokens (model_token_mask 0) must carry logprob exactly 0 (they were "
        "not sampled)"]
    # a model token may have logprob 0 too (a token the sampler was certain of)
    assert mask_errors([1, 1, 0, 0, 1], logprobs=(0.0, -1.0, 0.0, 0.0, -0.25)) == []


def test_every_completion_with_a_bad_mask_is_named():
    msg = to_proto(make_group(completions=[multi_turn(), multi_turn()]))
    msg.completions[0].model_token_mask = bytes([0, 1, 0, 0, 1])
    msg.completions[0].logprobs_le = np.zeros(5, "<f4").tobytes()
    msg.completions[1].model_token_mask = bytes([1, 1, 3, 0, 1])
    assert [e.split(":")[0] for e in validate_group(msg, LIMITS)] == ["completions[1].model_token_mask",
                                                                     "completions[0].model_token_mask"]


def test_a_payload_that_is_no_group_message_is_a_value_error_naming_the_payload():
    """A buffer entry's bytes cut short (or overwritten) in Redis raised protobuf's DecodeError, not the ValueError
    decode_trainable_group promises, saying only 'Error parsing message'."""
    payload = encode_group(make_group())
    assert decode_trainable_group(payload, LIMITS).group_id == "r/s0/1"
    for damaged in (payload[:-3], b"\xff" * 7):
        with pytest.raises(ValueError, match=rf"payload: {len(damaged)} bytes that do not parse as a RolloutGroup"):
            decode_trainable_group(damaged, LIMITS)
