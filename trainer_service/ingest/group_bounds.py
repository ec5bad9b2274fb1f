"""What the ingest checks of a group beyond its shape (common/rollouts/wire.py: validate_group): its free text within
prompts.max_text_chars, and its weight versions (the group's and each token run's) no newer than a trainer published.

A version ahead of every published one was accepted: the group filled a buffer place and was dropped as stale when
the trainer reached it (selection.py), and a token run from the future passed the collector with a negative lag,
counted as fresh by the off-policy diagnostics. The newest version a trainer may have published is read from the
audit trail: the last step it logged, or the checkpoint step a trainer resumed from (it publishes that version before
it logs a step), whichever is higher, plus admission's VERSIONS_AHEAD (a step's record is written in the background).
"""

from __future__ import annotations

import threading

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_errors import redis_call
from grpo_stream.protos import rollout_pb2
from grpo_stream.trainer_service.ingest.admission import VERSIONS_AHEAD

# free-text fields of a group: the only one not bounded by validate_group (ids are: GroupLimits.max_id_length)
TEXT_FIELDS = ("reference_answer",)


def text_errors(group: rollout_pb2.RolloutGroup, max_chars: int) -> list[str]:
    """A message naming each free-text field longer than `max_chars` (prompts.max_text_chars)."""
    return [f"{name}: {len(getattr(group, name))} characters, limit {max_chars} (prompts.max_text_chars: what an "
            "injected prompt's reference answer may hold); send a shorter one, or raise the limit"
            for name in TEXT_FIELDS if len(getattr(group, name)) > max_chars]


def newest_version(group: rollout_pb2.RolloutGroup) -> int:
    """The newest weight version the group names: its policy_version, or a later token run's."""
    return max([group.policy_version, *(max(c.version_runs) for c in group.completions if c.version_runs)])


def version_errors(group: rollout_pb2.RolloutGroup, ceiling: int) -> list[str]:
    """A message naming each version of `group` above `ceiling` (the newest a trainer may have published)."""
    fix = (f"the newest weight version a trainer published is at most {ceiling}; a sampler sends the version it "
           "generated with (does it read another run's weights?)")
    errors = []
    if group.policy_version > ceiling:
        errors.append(f"policy_version: {group.policy_version} is ahead of the newest weight version: {fix}")
    for i, c in enumerate(group.completions):
        if c.version_runs and max(c.version_runs) > ceiling:
            errors.append(f"completions[{i}].version_runs: {max(c.version_runs)} is ahead of the newest weight "
                          f"version: {fix}")
            break  # one message for all completions: a sampler sets them alike
    return errors


class VersionCeiling:
    """The newest weight version a trainer of this run may have published, read from Redis only when a group names a
    newer one than last read (so a normal batch costs no round trip); BufferUnavailable while Redis is away."""

    def __init__(self, buffer: RedisStreamBuffer):
        self.buffer = buffer
        self._known = -1
        self._lock = threading.Lock()

    def at_least(self, version: int) -> int:
        """The ceiling, read again unless `version` is within the last one read."""
        with self._lock:
            if version <= self._known:
                return self._known
        step = self.buffer.admission_state().trainer_step
        last = redis_call(lambda: self.buffer.client.xrevrange(self.buffer.k["audit:trainers"], count=1))
        resumed = _int_or_zero(last[0][1].get(b"from_step")) if last else 0
        ceiling = max(step, resumed) + VERSIONS_AHEAD
        with self._lock:
            # never lowered: a trainer restarted from an older checkpoint numbers from there (its groups of the
            # earlier process's versions are dropped as stale by the collector, as before this check)
            self._known = max(self._known, ceiling)
            return ceiling


def _int_or_zero(raw) -> int:
    """A damaged record (audit_trail.py reports it) reads as 0, never failing the ingest."""
    try:
        return int(raw or 0)
    except ValueError:
        return 0
