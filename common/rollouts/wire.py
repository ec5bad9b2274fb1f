"""Rollout groups in memory and on the wire (protobuf), and their validation.

Only protobuf bytes cross process boundaries: token ids and logprobs as raw
little-endian int32 / float32 arrays in `bytes` fields, so encoding and
decoding are memory copies. `validate_group` is the single gate used by the
ingest server; its messages name the offending field and the limit.

A multi-turn completion is everything after the prompt: model turns with the
observation tokens an environment wrote between them. `model_mask` says which
tokens the model sampled; only those have behaviour logprobs (observations
carry 0) and only those are trained on.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from google.protobuf.message import DecodeError

from grpo_stream.protos import rollout_pb2


@dataclasses.dataclass
class CompletionData:
    token_ids: np.ndarray          # int32 [n]
    logprobs: np.ndarray           # float32 [n]
    reward: float
    truncated: bool
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    versions: np.ndarray | None = None  # int64 [n]: version that drew each token; None: the group's policy_version
    model_mask: np.ndarray | None = None  # bool [n]: True where the model sampled the token; None: every token

    def model_tokens(self) -> np.ndarray:
        """[n] bool, True on the tokens the model sampled (all of them without a model_mask)."""
        if self.model_mask is None:
            return np.ones(len(self.token_ids), np.bool_)
        return np.asarray(self.model_mask, np.bool_)


def version_runs(versions: np.ndarray) -> tuple[list[int], list[int]]:
    """Per-token versions [n] -> (versions, run lengths), run-length encoded."""
    versions = np.asarray(versions, np.int64)
    if versions.size == 0:
        return [], []
    starts = np.flatnonzero(np.r_[True, versions[1:] != versions[:-1]])
    lengths = np.diff(np.r_[starts, versions.size])
    return versions[starts].tolist(), lengths.tolist()


def versions_of(c: rollout_pb2.Completion) -> np.ndarray | None:
    """Per-token versions from a completion's runs (None when it has none)."""
    if not c.version_runs:
        return None
    return np.repeat(np.asarray(c.version_runs, np.int64), np.asarray(c.version_run_lengths, np.int64))


@dataclasses.dataclass
class GroupData:
    group_id: str
    prompt_id: str
    prompt_token_ids: np.ndarray   # int32 [p]
    completions: list[CompletionData]
    policy_version: int
    sampler_id: str
    created_unix: float = 0.0
    reference_answer: str = ""
    data_position: int | None = None  # the prompt's index in its sampler's data stream
    injected: bool = False  # answers an injected prompt (prompt_id is its id)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([c.reward for c in self.completions], np.float32)


_I32, _F32 = np.dtype("<i4"), np.dtype("<f4")


def to_proto(group: GroupData) -> rollout_pb2.RolloutGroup:
    msg = rollout_pb2.RolloutGroup(
        group_id=group.group_id, prompt_id=group.prompt_id,
        prompt_token_ids=np.asarray(group.prompt_token_ids, np.int32).tolist(),
        policy_version=group.policy_version, sampler_id=group.sampler_id,
        created_unix=group.created_unix, reference_answer=group.reference_answer, injected=group.injected)
    if group.data_position is not None:
        msg.data_position = group.data_position
    for c in group.completions:
        runs, lengths = ([], []) if c.versions is None else version_runs(c.versions)
        if runs == [group.policy_version]:
            runs, lengths = [], []  # one version throughout: the group's, said once
        mask = None if c.model_mask is None else np.asarray(c.model_mask)
        msg.completions.append(rollout_pb2.Completion(
            token_ids_le=np.asarray(c.token_ids, _I32).tobytes(), logprobs_le=np.asarray(c.logprobs, _F32).tobytes(),
            reward=c.reward, truncated=c.truncated, reward_components=c.reward_components, version_runs=runs,
            version_run_lengths=lengths,
            # every token the model's: nothing sent, as a single-turn completion
            model_token_mask=b"" if mask is None or mask.all() else mask.astype(np.uint8).tobytes()))
    return msg


def token_ids_of(c: rollout_pb2.Completion) -> np.ndarray:
    """The completion's token ids as a read-only int32 view of the message bytes."""
    return np.frombuffer(c.token_ids_le, _I32)


def logprobs_of(c: rollout_pb2.Completion) -> np.ndarray:
    """The completion's behaviour logprobs as a read-only float32 view of the message bytes."""
    return np.frombuffer(c.logprobs_le, _F32)


def model_mask_of(c: rollout_pb2.Completion) -> np.ndarray | None:
    """The completion's model-token mask as bool [n] (True: the model sampled it), None when every token is the
    model's (no model_token_mask sent)."""
    if not c.model_token_mask:
        return None
    return np.frombuffer(c.model_token_mask, np.uint8).astype(np.bool_)


def from_proto(msg: rollout_pb2.RolloutGroup) -> GroupData:
    """Decode a validated message (lengths are whole int32 / float32 arrays)."""
    return GroupData(
        group_id=msg.group_id, prompt_id=msg.prompt_id,
        prompt_token_ids=np.array(msg.prompt_token_ids, np.int32),
        completions=[CompletionData(
            token_ids=token_ids_of(c), logprobs=logprobs_of(c),
            reward=c.reward, truncated=c.truncated, reward_components=dict(c.reward_components),
            versions=versions_of(c), model_mask=model_mask_of(c))
            for c in msg.completions],
        policy_version=msg.policy_version, sampler_id=msg.sampler_id,
        created_unix=msg.created_unix, reference_answer=msg.reference_answer,
        data_position=msg.data_position if msg.HasField("data_position") else None, injected=msg.injected)


def encode_group(group: GroupData) -> bytes:
    return to_proto(group).SerializeToString()


def decode_group(payload: bytes) -> GroupData:
    msg = rollout_pb2.RolloutGroup()
    msg.ParseFromString(payload)
    return from_proto(msg)


def decode_trainable_group(payload: bytes, limits: GroupLimits) -> GroupData:
    """A buffered group as the trainer reads it: decoded and checked against the trainer's own limits, since what
    the buffer holds may have been accepted under other ones (a restart with a smaller generation.max_new_tokens or
    num_generations, a standalone ingest with another config) or damaged in Redis. ValueError naming every problem;
    a group that passes fits the trainer's batch layout."""
    msg = rollout_pb2.RolloutGroup()
    try:
        msg.ParseFromString(payload)
    except DecodeError as exc:  # cut short or overwritten in Redis: protobuf's own error is no ValueError
        raise ValueError(f"payload: {len(payload)} bytes that do not parse as a RolloutGroup message ({exc})") \
            from None
    errors = validate_group(msg, limits)
    if errors:
        raise ValueError("; ".join(errors))
    return from_proto(msg)


# The highest data position the buffer records exactly: its Lua scripts hold numbers as doubles and write the
# accepted record with cjson, which keeps 14 significant digits, so 10**14 would be stored as 1e+14 (a record the
# audit and compaction read as damaged, which halts compaction for the run) and 10**17 as a positions value no
# reader parses (GetDataPosition then fails for that sampler). A sampler counts its prompts from 0: far below it.
MAX_DATA_POSITION = 10**14 - 1

# The largest |reward| the ingest accepts: the advantage estimators hand float32 to the update, and without a bound a
# finite float32 reward (up to 3.4e38) overflows there (drgrpo's r - mean(r) and rloo's r - mean(others) reach twice
# it: inf advantages, then a non-finite loss). Rewards are weighted sums of scores near [0, 1]: 1e6 is far above any
# real one.
MAX_ABS_REWARD = 1e6
# Reward components are names chosen by the sender, each a train/reward/<name> metric series in the trainer: a
# completion holds at most this many, with names of at most this many characters (the trainer also caps the series
# a run keeps: reports/step_report.py MAX_COMPONENT_SERIES).
MAX_REWARD_COMPONENTS = 64
MAX_COMPONENT_NAME_CHARS = 128


@dataclasses.dataclass(frozen=True)
class GroupLimits:
    """What a valid group looks like for this run (from the run config)."""

    num_generations: int
    max_prompt_tokens: int
    max_new_tokens: int
    vocab_size: int
    max_id_length: int = 128


def group_limits(generation, vocab_size: int) -> GroupLimits:
    """The limits of a run: its `generation` config section and its tokenizer's vocabulary size (what the ingest
    accepts and the trainer trains)."""
    return GroupLimits(generation.num_generations, generation.max_prompt_tokens, generation.max_new_tokens, vocab_size)


def validate_group(msg: rollout_pb2.RolloutGroup, limits: GroupLimits) -> list[str]:
    """Every problem with `msg`, each naming the field and the limit; empty when valid."""
    errors: list[str] = []
    for name in ("group_id", "prompt_id", "sampler_id"):
        value = getattr(msg, name)
        if not value:
            errors.append(f"{name}: must not be empty")
        elif len(value) > limits.max_id_length:
            errors.append(f"{name}: {len(value)} characters, limit {limits.max_id_length}")
    if msg.policy_version < 0:
        errors.append(f"policy_version: {msg.policy_version} is negative")
    if msg.injected and msg.HasField("data_position"):
        # the buffer keys data positions by sampler: one on an answer raised the sampler's recorded position (a
        # restarted sampler resumed there, skipping its data) or, at or below the compacted one, was acknowledged as a
        # duplicate and never recorded as the prompt's answer
        errors.append(f"data_position: {msg.data_position} set on an injected prompt's answer (injected=true); "
                      "leave it unset: only groups drawn from a sampler's data stream have one")
    elif msg.HasField("data_position") and msg.data_position < 0:
        errors.append(f"data_position: {msg.data_position} is negative; leave it unset for prompts not drawn from "
                      "a data stream")
    elif msg.HasField("data_position") and msg.data_position > MAX_DATA_POSITION:
        errors.append(f"data_position: {msg.data_position} is above {MAX_DATA_POSITION}, the highest the buffer "
                      "records exactly; a sampler numbers its data stream's prompts from 0")
    elif not msg.injected and not msg.HasField("data_position"):
        # a group's id is refused as a second copy by the accepted-ids record, which compaction trims: after that a
        # resent copy is told apart by its sampler's data position alone, so a group without one could train twice
        errors.append("data_position: required for a group drawn from a sampler's data stream (its index there; "
                      "groups answering injected prompts set injected=true instead)")
    prompt = np.array(msg.prompt_token_ids, np.int64)
    if not 0 < prompt.size <= limits.max_prompt_tokens:
        errors.append(f"prompt_token_ids: {prompt.size} tokens, must be 1..{limits.max_prompt_tokens} "
                      "(generation.max_prompt_tokens)")
    elif prompt.min() < 0 or prompt.max() >= limits.vocab_size:
        errors.append(f"prompt_token_ids: ids must be in [0, {limits.vocab_size})")
    if len(msg.completions) != limits.num_generations:
        errors.append(f"completions: {len(msg.completions)} given, generation.num_generations="
                      f"{limits.num_generations}")
    # Shapes per completion; values are checked on all completions at once and
    # only searched one by one when something is wrong.
    shaped = []
    for i, c in enumerate(msg.completions):
        where = f"completions[{i}]"
        n_ids, n_lp = len(c.token_ids_le), len(c.logprobs_le)
        if n_ids % 4 or n_lp % 4:
            field = "token_ids_le" if n_ids % 4 else "logprobs_le"
            errors.append(f"{where}.{field}: {n_ids if n_ids % 4 else n_lp} bytes is not a whole number of "
                          "4-byte values (int32 ids / float32 logprobs, little-endian)")
            continue
        n_tok, n_lp = n_ids // 4, n_lp // 4
        if n_tok != n_lp:
            errors.append(f"{where}.logprobs_le: {n_lp} values for {n_tok} token ids; send one logprob per token")
            continue
        if not 0 < n_tok <= limits.max_new_tokens:
            errors.append(f"{where}.token_ids_le: {n_tok} tokens, must be 1..{limits.max_new_tokens} "
                          "(generation.max_new_tokens)")
            continue
        errors.extend(_reward_errors(c, where))
        errors.extend(_version_run_errors(c, n_tok, msg.policy_version, where))
        if c.model_token_mask and len(c.model_token_mask) != n_tok:
            errors.append(f"{where}.model_token_mask: {len(c.model_token_mask)} bytes for {n_tok} tokens; send one "
                          "byte per token (1 = the model sampled it, 0 = an observation), or none when every token is "
                          "the model's")
            continue
        shaped.append((where, c))
    if shaped:
        errors.extend(_value_errors(shaped, limits.vocab_size))
    return errors


def _value_errors(shaped: list[tuple[str, rollout_pb2.Completion]], vocab_size: int) -> list[str]:
    """Token ids, logprobs and model-token masks of completions whose shapes are valid, checked all at once; the
    completions are searched one by one only when something is wrong."""
    errors: list[str] = []
    sizes = np.array([len(c.token_ids_le) // 4 for _, c in shaped])
    bounds = np.cumsum(sizes)[:-1]
    starts = np.r_[0, bounds]

    def report(ok: np.ndarray, message: str) -> None:
        if not ok.all():
            errors.extend(f"{where}.{message}" for (where, _), good in zip(shaped, np.split(ok, bounds))
                          if not good.all())

    ids = np.frombuffer(b"".join(c.token_ids_le for _, c in shaped), _I32)
    report((ids >= 0) & (ids < vocab_size), f"token_ids_le: ids must be in [0, {vocab_size})")
    logprobs = np.frombuffer(b"".join(c.logprobs_le for _, c in shaped), _F32)
    report(np.isfinite(logprobs) & (logprobs <= 0.0), "logprobs_le: must be finite and <= 0")
    if not any(c.model_token_mask for _, c in shaped):
        return errors  # single-turn: every token is the model's
    mask = np.frombuffer(b"".join(c.model_token_mask or b"\x01" * n for (_, c), n in zip(shaped, sizes)), np.uint8)
    report(mask <= 1, "model_token_mask: values must be 0 (an observation token) or 1 (a token the model sampled)")
    model = mask == 1
    any_model = np.add.reduceat(model, starts) > 0
    report(np.repeat(any_model, sizes), "model_token_mask: no token is the model's; a completion holds at least one "
           "token the model sampled (mark it 1)")
    report(np.repeat(model[starts] | ~any_model, sizes), "model_token_mask: the first token is an observation; a "
           "completion starts with the model's turn (what the environment wrote before it belongs in the prompt)")
    report(model | (mask > 1) | (logprobs == 0.0), "logprobs_le: observation tokens (model_token_mask 0) must carry "
           "logprob exactly 0 (they were not sampled)")
    return errors


def _reward_errors(c: rollout_pb2.Completion, where: str) -> list[str]:
    """A completion's reward (finite, |r| <= MAX_ABS_REWARD) and reward components (at most MAX_REWARD_COMPONENTS,
    names of 1..MAX_COMPONENT_NAME_CHARS characters, finite values); at most one message per field."""
    errors = []
    if not (math.isfinite(c.reward) and abs(c.reward) <= MAX_ABS_REWARD):
        errors.append(f"{where}.reward: {c.reward} must be finite and within +-{MAX_ABS_REWARD:g} (the advantage "
                      "estimators work in float32); scale the task's rewards down")
    if len(c.reward_components) > MAX_REWARD_COMPONENTS:
        return errors + [f"{where}.reward_components: {len(c.reward_components)} names, limit "
                         f"{MAX_REWARD_COMPONENTS} (each is a metric series in the trainer)"]
    sizes = [len(name) for name in c.reward_components]
    if sizes and not 0 < min(sizes) <= max(sizes) <= MAX_COMPONENT_NAME_CHARS:
        bad = next(n for n in sizes if not 0 < n <= MAX_COMPONENT_NAME_CHARS)
        return errors + [f"{where}.reward_components: a name of {bad} characters; names must be "
                         f"1..{MAX_COMPONENT_NAME_CHARS} characters"]
    bad_values = {name: value for name, value in c.reward_components.items() if not math.isfinite(value)}
    if bad_values:
        name = min(bad_values)  # a map's order is the parser's: name the same one every time
        value = bad_values[name]
        more = f" (and {len(bad_values) - 1} more)" if len(bad_values) > 1 else ""
        errors.append(f"{where}.reward_components[{name!r}]: {value} must be finite{more}")
    return errors


def _version_run_errors(c: rollout_pb2.Completion, n_tok: int, policy_version: int, where: str) -> list[str]:
    runs, lengths = list(c.version_runs), list(c.version_run_lengths)
    if not runs and not lengths:
        return []
    if len(runs) != len(lengths):
        return [f"{where}.version_run_lengths: {len(lengths)} lengths for {len(runs)} version_runs; send one each"]
    errors = []
    if sum(lengths) != n_tok or min(lengths) == 0:
        errors.append(f"{where}.version_run_lengths: must be positive and sum to the {n_tok} tokens (got {lengths})")
    if runs[0] < policy_version or any(b < a for a, b in zip(runs, runs[1:])):
        errors.append(f"{where}.version_runs: must be non-decreasing and >= the group's policy_version "
                      f"{policy_version} (its oldest token's version); got {runs}")
    return errors
