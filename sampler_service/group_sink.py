"""Where a sampler's finished groups go: scored, built and handed to the rollout sender, one by one as each group's
last episode ends, on a thread of its own (never the engine's, never the feeder's).

The rollout stream calls `put` with a finished group (a quick hand-over on whichever thread ended it); the sink's
thread builds it with the one group builder (common/episodes/groups.py: rewards, the version rule), and puts it on
the sender's backlog, waiting while the backlog is full (the feeder starts no group meanwhile). A group one of whose
episodes failed to become a completion (a verifiers rollout that raised, turns that are not one sequence) is logged
and left out; after MAX_FAILED_IN_A_ROW such groups in a row the sampler stops with the last reason (the
environment or the run's settings are wrong: generating more would fail the same way). Rewards are called from here,
each in a worker process with a deadline (common/tasks/reward_workers.py), so a slow reward delays only the sending
of groups, never decoding, and one that never ends scores 0. A reward that raises (or returns NaN) on a completion
fails its group the same way (logged once per reward, with its error): never scored 0, never the sampler's end unless
it fails MAX_FAILED_IN_A_ROW groups in a row.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable

from grpo_stream.common.episodes.groups import build_group
from grpo_stream.common.episodes.stream import GroupRun
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.common.tasks.reward_workers import RewardWorker, WorkerClosed
from grpo_stream.common.tasks.rewards import RewardError

log = logging.getLogger(__name__)
MAX_ERROR_KINDS_LOGGED = 20  # distinct episode errors logged (each kind once); all are counted
MAX_FAILED_IN_A_ROW = 64  # groups failed one after another before the sampler stops (a wrong setup, not bad luck)
PUT_WAIT_S = 0.5


RATE_WINDOW_S = 60.0  # the throughput a sampler reports is over the last minute (or since its stream started)


def window_rates(events, now: float, since: float, window_s: float = RATE_WINDOW_S) -> tuple[float, float, float]:
    """(groups/s, tokens/s, seconds) over the window that ends `now`: the last `window_s`, or since the rollout
    stream started at `since` when that is shorter. `events`: (time, tokens) per group sent. Dividing by the time
    from the window's first group instead (as before) made 2 groups sent together 100 s into a run read 2 groups/s."""
    span = max(min(window_s, now - since), 1e-3)
    recent = [n for t, n in events if now - t <= span]
    return len(recent) / span, sum(recent) / span, span


class RateWindow:
    """(time, tokens) per group sent over the last `window_s`, for `window_rates`: events older than the window are
    dropped as new ones come, so memory follows the rate and every group of the window is counted (a cap on the
    count instead, 4096 before, made every rate above 4096 / 60 s read 68 groups/s). Thread-safe: the sink's thread
    adds, the feeder's reads."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._events: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def add(self, now: float, tokens: int) -> None:
        with self._lock:
            self._events.append((now, tokens))
            while self._events and now - self._events[0][0] > self.window_s:
                self._events.popleft()

    def rates(self, now: float, since: float) -> tuple[float, float, float]:
        """window_rates over the events kept."""
        with self._lock:
            events = list(self._events)
        return window_rates(events, now, since, self.window_s)


class GroupSink:
    """See the module docstring. `client`: the RolloutClient; `metrics`: lifecycle.SamplerMetrics; `abandon()`: True
    when groups are no longer wanted (a stop, or the final version fetched); `left_out(run)`: told of each group
    left out as failed (on the sink's thread), so the feeder can start another in its place."""

    def __init__(self, client, metrics, tokenizer, sampler_id: str, turn_weight: float, abandon: Callable[[], bool],
                 rewards: RewardWorker, left_out: Callable[[GroupRun], None] = lambda run: None):
        self.client, self.metrics, self.tokenizer, self.sampler_id = client, metrics, tokenizer, sampler_id
        self.turn_weight, self.abandon, self.rewards, self.left_out = turn_weight, abandon, rewards, left_out
        self.groups_sent = self.groups_generated = self.tokens_generated = 0
        self.groups_failed = self._failed_in_a_row = 0
        self.episodes_errored = 0  # episodes an environment ended with an error (trained as they stand)
        self._errors_logged: set[str] = set()
        self._reward_errors_logged: set[str] = set()  # rewards whose error was logged (each once)
        self.rate = RateWindow()  # groups sent over the last minute: the throughput the sampler reports
        self.first_sent: float | None = None
        self._queue: queue.Queue[GroupRun | None] = queue.Queue()
        self._pending = 0  # handed over by put and not yet on the sender's backlog (nor left out): queued or scoring
        self._pending_lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = self._given_up = False  # close() called; its wait ran out (the groups left are left out)
        self._thread = threading.Thread(target=self._run, name=f"{sampler_id}-groups", daemon=True)
        self._thread.start()

    def put(self, run: GroupRun) -> None:
        """A group ended (the rollout stream's on_group)."""
        with self._pending_lock:
            self._pending += 1
        self._queue.put(run)

    def pending(self) -> int:
        """Groups ended and not yet on the sender's backlog: queued, and the one being scored (the feeder counts them
        with the backlog, so a slow reward holds generation back instead of piling ended groups up here)."""
        with self._pending_lock:
            return self._pending

    def check(self) -> None:
        """Raise what stopped the sink (too many failed groups, a bug)."""
        if self._error is not None:
            raise self._error

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the groups already handed over (each waits PUT_WAIT_S at a time while the backlog is full).
        Past `timeout_s` the reward worker is closed under the group being scored, and a group waiting for room in
        the backlog stops waiting: that group and those still queued are left out (not counted as failed groups), and
        no worker is started again. Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # said, not silent: these groups' data positions are skipped, never trained
            # without it, a sampler that ended on an error (no stop asked, so `abandon` is False) beside a full
            # backlog kept this thread offering its group to a sender that was closed next, for the process's life
            self._given_up = True
            log.warning("%s: stopped with about %d ended groups not yet scored and sent (the sink did not finish "
                        "within %gs); they are left out", self.sampler_id, self.pending(), timeout_s)
        self.rewards.close()

    def _run(self) -> None:
        while True:
            run = self._queue.get()
            if run is None:
                return
            try:
                self._send(run)
            except BaseException as exc:  # noqa: BLE001 - raised on the feeder's thread by check()
                self._error = exc
                return
            finally:
                with self._pending_lock:
                    self._pending -= 1

    def _send(self, run: GroupRun) -> None:
        work = run.work
        self.groups_generated += work.train  # the run's waste is counted from these
        failed = next((r.failed for r in run.results if r.failed), None)
        if failed:
            self.left_out(run)
            self._failed(work.group_id, failed)
            return
        try:
            group = build_group(work, run.results, self.sampler_id, self.tokenizer, self.turn_weight,
                                run.version_at_start, self.rewards.call)
        except RewardError as exc:  # one completion a reward cannot score: its group, not the sampler
            self.left_out(run)
            if not isinstance(exc.__cause__, WorkerClosed):  # else the sink closes: left out as close() says
                self._reward_failed(work.group_id, exc)
            return
        self._failed_in_a_row = 0  # (after scoring: a reward failing every group must still reach the limit)
        errors = [r.error for r in run.results if r.error]
        if errors:
            self._errored(work.group_id, errors)
        # the tokens the model sampled: an environment's observation tokens between turns were not generated
        tokens = int(sum(c.model_tokens().sum() for c in group.completions))
        message = to_proto(group)
        while not self.client.put(message, timeout_s=PUT_WAIT_S, epoch=work.epoch, evaluation_only=not work.train,
                                  started_at=run.version_at_start):
            if self.abandon() or self._given_up:
                return
        self.groups_sent += 1
        self.tokens_generated += tokens
        self.metrics.groups.inc()
        self.metrics.tokens.inc(tokens)
        self.rate.add(time.monotonic(), tokens)
        if self.first_sent is None:
            self.first_sent = time.monotonic()

    def _errored(self, group_id: str, errors: list[str]) -> None:
        """Episodes an environment step, or the rendering of its observation, ended with an error are trained as they
        stand (cut at that turn); all are counted (the sampler's summary: episodes_errored) and the first of each
        kind is logged, so that an environment or a chat template that fails every episode is seen."""
        self.episodes_errored += len(errors)
        for error in errors:
            kind = error[:120]
            if kind not in self._errors_logged and len(self._errors_logged) < MAX_ERROR_KINDS_LOGGED:
                self._errors_logged.add(kind)
                log.warning("%s: an episode of group %s ended with an error at its turn (it is trained up to there; "
                            "later episodes with this error are counted, not logged): %s", self.sampler_id,
                            group_id, error[:500])

    def _reward_failed(self, group_id: str, exc: RewardError) -> None:
        """A group one of whose completions a reward raised on: left out as a failed group, the error logged once per
        reward (a reward that raises on a share of the model's texts would otherwise log every such group)."""
        if exc.reward not in self._reward_errors_logged:
            self._reward_errors_logged.add(exc.reward)
            log.warning("%s: group %s not sent: %s (later groups this reward fails are counted in groups_failed, not "
                        "logged)", self.sampler_id, group_id, str(exc)[:500])
        self._failed(group_id, str(exc), logged=True)

    def _failed(self, group_id: str, why: str, logged: bool = False) -> None:
        self.groups_failed += 1
        self._failed_in_a_row += 1
        if not logged:
            log.warning("%s: group %s not sent: %s", self.sampler_id, group_id, why[:500])
        if self._failed_in_a_row >= MAX_FAILED_IN_A_ROW:
            raise ValueError(f"the last {self._failed_in_a_row} groups all failed, the last with: {why[:500]}; fix "
                             "the environment or the run's settings")
