"""Admission control: a sampler starts a group only if the trainer can still train it within trainer.max_staleness.

The trainer trains groups in buffer order, `groups_per_step` per step, and step s uses the weights of version s-1,
so a group of version v trained at step s has staleness (s-1) - v. When the trainer has finished step S and
`queued` groups are ahead of a group started now (waiting in the buffer, read for the step in progress, or in
flight at any sampler), that group is trained at step S + 1 + queued // groups_per_step, with staleness
S - v + queued // groups_per_step. It is therefore trainable when

    queued < (max_staleness - (S - v) + 1) * groups_per_step

(AReaL's bound on the samples in flight, counted from the buffer instead of a global sample counter, so that a
group dropped or rejected anywhere frees its place). Two more limits: the trainer needs only
(steps - S) * groups_per_step more groups, and groups dynamic sampling passes over (zero reward variance) take no
step's place, so both bounds are divided by the fraction of groups that were trained rather than filtered.

Groups in flight are what the ingest granted each sampler, less the groups of it the ingest answered since and those
the sampler says it no longer holds; a sampler silent for `lease_s` (dead) no longer holds any, and a restarted one
reports its own count. What a sampler reports only ever lowers its own count: a report of more groups than it was
granted (`in_flight=2**31-1`), or of a weight version older than one it asked with before, would otherwise hold every
other sampler's grants at 0 (one Admit call stopped every sampler for the lease, renewably). The price: after an
ingest restart, groups started before it are not counted until they arrive (at most a batch and a backlog per
sampler), so a few of them may train later than counted, or be dropped as stale. A trainer restarted from an older
checkpoint numbers its versions from there: a version more than VERSIONS_AHEAD past its last step is an earlier
trainer process's, neither remembered as the sampler's newest nor kept in place of groups of the versions trained now.

Groups a sampler starts now may still reach the buffer before groups another sampler started earlier (a shorter
batch), which then train later than counted. So a grant is checked against the oldest version in flight anywhere,
not only the asking sampler's: whatever order the groups arrive in, each one in flight stays within the bound.
Groups in flight of a version the trainer has already passed by more than max_staleness will be dropped whenever they
arrive: they hold no place and bound nothing, so grants a sampler holds without ever sending their groups stop
holding back the others once the trainer has moved past them. What is left over (a group past the bound because a
dynamic-sampling filter rate changed, or a trainer restarted) shows in the summary's generation_wasted_fraction.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time

from grpo_stream.common.rollouts.buffer import AdmissionState

log = logging.getLogger(__name__)
REPLACED_KEPT = 8  # processes remembered per sampler id as replaced (a crash-looping sampler makes one per start)
RETRY_AFTER_MS = 100  # a refused sampler asks again this soon: the trainer frees groups_per_step places per step
# how far a sampler's weight version may lead the trainer's last logged step: version s is published after step s,
# and the step's audit record is written in the background, a step at most behind
VERSIONS_AHEAD = 2
# group ids remembered as answered (a copy is sent again within a sampler's reconnect, long before this many more
# groups are answered; each id is at most GroupLimits.max_id_length characters)
ANSWERED_KEPT = 65_536


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    groups_per_step: int
    max_staleness: int
    steps: int  # trainer.steps: the trainer needs no groups after its last step
    lease_s: float = 600.0
    max_samplers: int = 1024  # sampler ids counted at once; a token may speak for `<name>-<n>`, any n


def admissible(state: AdmissionState, queued: int, policy_version: int, limits: AdmissionLimits) -> int:
    """How many more groups of `policy_version` can start now, with `queued` groups in flight at the samplers
    (the buffer's waiting groups are added here); 0 when none."""
    lag = max(0, state.trainer_step - policy_version)
    horizon = (limits.max_staleness - lag + 1) * limits.groups_per_step
    needed = (limits.steps - state.trainer_step) * limits.groups_per_step
    seen = state.trained + state.dropped_filtered
    kept = state.trained / seen if seen else 1.0  # share of groups that take a step's place
    bound = min(horizon, needed) / max(kept, 0.05)
    return max(0, math.floor(bound) - state.waiting - queued)


class SharedSamplerId(ValueError):
    """A sampler process that another process with the same sampler id replaced asks again: two samplers run under
    one id (two given one index or one token), and their counts, group ids and data positions would collide."""


class AdmissionControl:
    """The ingest's grants: per sampler, its groups in flight by weight version, and when it was last heard from."""

    def __init__(self, limits: AdmissionLimits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self._versions: dict[str, collections.Counter] = {}  # sampler -> {version: groups in flight}
        self._newest: dict[str, int] = {}  # sampler -> the newest weight version it asked with in its lease
        self._granted: dict[str, int] = {}  # sampler -> groups granted since its last claim of injected prompts
        self._seen: dict[str, float] = {}
        # sampler -> (the process that asked last, processes it replaced): a restart replaces its predecessor for good
        self._processes: dict[str, tuple[str, collections.deque]] = {}
        # (sampler, group id) of the groups answered lately, oldest first: a copy sent again is not counted again
        self._answered: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "granted": 0, "refused": 0}

    def in_flight(self) -> dict[str, int]:
        """Groups in flight per sampler whose lease has not run out."""
        with self._lock:
            self._expire(self.clock())
            return {sid: sum(c.values()) for sid, c in self._versions.items()}

    def _expire(self, now: float) -> None:
        for sid in [s for s, seen in self._seen.items() if now - seen > self.limits.lease_s]:
            self._drop(sid)

    def _drop(self, sampler_id: str) -> None:
        del self._seen[sampler_id], self._versions[sampler_id]
        self._newest.pop(sampler_id, None)
        self._granted.pop(sampler_id, None)
        self._processes.pop(sampler_id, None)

    def _check_process(self, sampler_id: str, process: str) -> None:
        """SharedSamplerId when `process` was replaced by another process of `sampler_id` (one that asked after it);
        otherwise `process` is the sampler's now. A sampler sending no process id ("") is not checked."""
        if not process:
            return
        current, replaced = self._processes.get(sampler_id, ("", collections.deque(maxlen=REPLACED_KEPT)))
        if process == current:
            return
        if process in replaced:
            raise SharedSamplerId(
                f"sampler_id {sampler_id!r}: another sampler process started with this id and asks for admission "
                "now; two running samplers must not share a sampler id (their group ids and data positions "
                "collide): give each its own sampler index and token. This process stops")
        if current:
            replaced.append(current)
        self._processes[sampler_id] = (process, replaced)

    def take_granted(self, sampler_id: str) -> int | None:
        """The groups granted to `sampler_id` since the last call (None: none in its lease): a sampler claims
        injected prompts for the groups it was granted, so this is how many groups its claim may fill; counted
        from 0 again."""
        with self._lock:
            return self._granted.pop(sampler_id, None)

    def admit(self, state: AdmissionState, sampler_id: str, wanted: int, policy_version: int,
              reported_in_flight: int, process: str = "") -> tuple[int, int]:
        """Grant up to `wanted` groups to `sampler_id`'s process `process`; returns (granted, groups queued ahead of
        them). SharedSamplerId: another process of that sampler id replaced this one."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            self._check_process(sampler_id, process)
            own = self._versions.setdefault(sampler_id, collections.Counter())
            # no version of the trainer now running is this far ahead of its last logged step: such a version is an
            # earlier trainer process's, which got further before it was restarted from an older checkpoint (its
            # successor's numbers restart lower: docs/rollouts-and-weights.md), and its groups are never sent
            ceiling = state.trainer_step + VERSIONS_AHEAD
            _reconcile(own, reported_in_flight, ceiling)
            # a sampler installs versions in order: a request with an older one than it asked with before is
            # counted at that newer one, so a false version misjudges only the asking sampler's own groups; one
            # remembered from an earlier trainer process is forgotten, or every grant until the trainer caught up
            # with it would be judged as if the sampler were that far ahead (granting what is dropped as stale)
            remembered = self._newest.get(sampler_id, policy_version)
            if remembered > ceiling:
                remembered = policy_version
            version = self._newest[sampler_id] = max(policy_version, remembered)
            counted = collections.Counter()  # version -> groups in flight that can still be trained
            for c in self._versions.values():
                counted.update({v: n for v, n in c.items()
                                if n > 0 and state.trainer_step - v <= self.limits.max_staleness})
            queued = sum(counted.values())
            # the new groups may reach the buffer before groups started earlier anywhere: every group in flight
            # must still fit behind them, so the bound is that of the oldest version in flight
            oldest = min([version, *counted])
            granted = min(wanted, admissible(state, queued, oldest, self.limits))
            if granted:
                own[version] += granted
                self._granted[sampler_id] = self._granted.get(sampler_id, 0) + granted
            self._seen[sampler_id] = now
            if len(self._seen) > self.limits.max_samplers:
                self._forget_longest_silent()
            self.stats["requests"] += 1
            self.stats["granted"] += granted
            self.stats["refused"] += granted == 0 < wanted  # (a request for none is a sampler's release)
        return granted, state.waiting + queued

    def _forget_longest_silent(self) -> None:
        """Past max_samplers ids, the one heard from longest ago goes (as if its lease ran out): its own next
        request reports what it holds, so only its groups still in flight go uncounted meanwhile."""
        quiet = min(self._seen, key=self._seen.__getitem__)
        log.warning("admission: more than %d sampler ids (sampler.admission_max_samplers); forgetting %r, silent "
                    "for %.0fs", self.limits.max_samplers, quiet[:64], self.clock() - self._seen[quiet])
        self._drop(quiet)

    def answered(self, sampler_id: str, versions: list[int], group_ids: list[str] | None = None) -> None:
        """Groups of `sampler_id` with these weight versions (and these ids, one each) were answered for good
        (accepted or rejected): they are in the buffer, or nowhere, now. A group id answered before is a copy sent
        again by a sampler that lost the first answer: counted once (each copy took another group off the count, so
        the ingest granted past the bound for as long as the sampler's lease)."""
        with self._lock:
            if group_ids is not None:  # (two copies in one batch too: each id is remembered as it is counted)
                fresh = []
                for version, group_id in zip(versions, group_ids):
                    if (sampler_id, group_id) not in self._answered:
                        self._answered[(sampler_id, group_id)] = None
                        fresh.append(version)
                while len(self._answered) > ANSWERED_KEPT:
                    self._answered.popitem(last=False)
                versions = fresh
            own = self._versions.get(sampler_id)
            if own is None:
                return
            for version in versions:
                if own[version] <= 0:  # not a version we granted (e.g. granted before an ingest restart)
                    version = min((v for v, n in own.items() if n > 0), default=None)
                    if version is None:
                        break
                own[version] -= 1
            self._seen[sampler_id] = self.clock()


def _reconcile(own: collections.Counter, reported: int, ceiling: int) -> None:
    """Make the count the ingest holds for a sampler match the sampler's own where that is lower (which groups it
    still holds it knows exactly): groups it discarded are taken first from versions above `ceiling` (an earlier
    trainer process's, whose groups a sampler discards when the trainer restarts), then from the oldest. A report of
    more than the ingest granted and has not seen answered changes nothing: the ingest counts what it granted, never
    more."""
    for v in [v for v, n in own.items() if n <= 0]:
        del own[v]
    extra = sum(own.values()) - reported
    for v in sorted(own, key=lambda v: (v <= ceiling, v)):
        if extra <= 0:
            break
        take = min(extra, own[v])
        own[v] -= take
        extra -= take
