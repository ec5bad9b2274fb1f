"""The feeder's look at what the sampler holds (sampler_service/loop.py: Sampler._feed, _held_back): the count it
reports to the ingest's Admit is never negative (the ingest refuses a negative one for good, which stopped the
sampler), ended groups still being scored count against the backlog (a reward slower than generation piled them up
without bound), a group moving on between the feeder's reads is never missed, each group it starts carries the
trainer epoch of the weights installed, and an engine that fails while the feeder waits ends it with its error."""

import collections
import threading
import types

import pytest

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.episodes.single_turn import SingleTurn
from grpo_stream.common.episodes.stream import GroupRun, RolloutStream
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.sampler_service.group_sink import GroupSink
from grpo_stream.sampler_service.lifecycle import SamplerMetrics
from grpo_stream.sampler_service.loop import Sampler
from tests.support import wait_for


class Client:
    """A rollout client whose ingest acknowledges at once: nothing stays unacknowledged."""

    def __init__(self, unacked=0):
        self.unacked, self.sent = unacked, 0

    def put(self, message, timeout_s, epoch="", evaluation_only=False, started_at=-1):
        self.sent += 1
        return True


class BlockedReward:
    """A reward that answers only once `release` is set (a slow verifier, a judge near its deadline)."""

    def __init__(self):
        self.release, self.scoring = threading.Event(), threading.Event()

    def call(self, name, fn, text, reference):
        self.scoring.set()
        self.release.wait(10)
        return 1.0

    def close(self):
        self.release.set()


def feeder(cfg, client, sink, admitted, epoch="e1"):
    """A Sampler with only what _feed and _held_back read (the feeder stands for its parts too: parts.client)."""
    sampler = Sampler.__new__(Sampler)
    sampler.cfg, sampler.client, sampler.sink, sampler._held_since = cfg, client, sink, None
    sampler.rows_in_flight = sampler.slots = 4 * cfg.generation.num_generations
    sampler.groups_started, sampler.waited_for_weights_s = 0, 0.0
    sampler.left_out_at_version, sampler._left_out_lock = collections.Counter(), threading.Lock()
    sampler.sync = types.SimpleNamespace(too_stale=lambda: False, lag=lambda: 0)
    sampler.weights = types.SimpleNamespace(version=3, epoch=epoch, groups_at_version=0, group_started=lambda: None,
                                            feeder_passed=lambda: None,
                                            staged=types.SimpleNamespace(waiting=lambda: False))
    sampler.admission = types.SimpleNamespace(
        admit=lambda wanted, version, holding: admitted.append(holding) or wanted)
    sampler.stream = RolloutStream(lambda rng, n: [None] * n, lambda run: None)
    sampler.rollouts = sampler.injected_rollouts = SingleTurn(8)
    g = cfg.generation.num_generations
    works = (GroupWork(types.SimpleNamespace(prompt_id=f"p{i}", answer="1", prompt="x"), [1, 2], g,
                       RewardSet(cfg.task.rewards), f"run/sampler-0/{i}", i, None) for i in range(1000))
    sampler.source = types.SimpleNamespace(
        injected_rows_waiting=lambda: 0,
        next_groups=lambda groups, rows, version: [next(works) for _ in range(min(groups, rows // g))])
    return sampler


def ended_group(cfg, i):
    rows = cfg.generation.num_generations
    work = GroupWork(types.SimpleNamespace(prompt_id=f"p{i}", answer="1"), [1, 2], rows, RewardSet(cfg.task.rewards),
                     f"run/sampler-0/{i}", i, None)
    run = GroupRun(work, None, 0)
    for row in range(rows):
        run.results[row] = EpisodeResult(tokens=[1] * 4, logprobs=[0.0] * 4, model_mask=[True] * 4,
                                         versions=[0] * 4, finished=True)
    return run


def test_the_in_flight_count_sent_to_admission_is_never_negative(small_cfg):
    """Whatever the client's count reads (it read -1 when the sender settled a group before put counted it), the
    ingest is never sent a negative in_flight: it answers INVALID_ARGUMENT, and the sampler exits for good."""
    admitted = []
    sampler = feeder(small_cfg, Client(unacked=-1), types.SimpleNamespace(pending=lambda: 0), admitted)
    sampler._feed(sampler)
    assert admitted == [0] and sampler.groups_started > 0


def test_groups_started_carry_the_installed_trainer_epoch(small_cfg):
    """The epoch travels with the group to the rollout client, which drops groups of a trainer that restarted."""
    started = []
    sampler = feeder(small_cfg, Client(), types.SimpleNamespace(pending=lambda: 0), [], epoch="epoch-a")
    start = sampler.stream.start
    sampler.stream.start = lambda work, kind, version=0: (started.append(work.epoch), start(work, kind, version))[1]
    sampler._feed(sampler)
    assert started and set(started) == {"epoch-a"}


def test_ended_groups_waiting_for_a_slow_reward_hold_the_feeder_back(small_cfg):
    """With admission off (or an ingest without Admit) only the backlog limit stops the feeder. Groups the sink has
    not scored yet were not counted, so with a reward slower than generation they piled up without bound."""
    cfg, reward = small_cfg, BlockedReward()
    limit = cfg.sampler.backlog_max_groups
    client = Client()
    sink = GroupSink(client, SamplerMetrics("s"), types.SimpleNamespace(decode=lambda ids: "1"), "s", 0.0,
                     lambda: False, reward)
    try:
        sampler = feeder(cfg, client, sink, [])
        for i in range(limit - 1):
            sink.put(ended_group(cfg, i))
        wait_for(reward.scoring.is_set, 10, "the sink to score the first group")
        assert sink.pending() == limit - 1 and not sampler._held_back()  # the one being scored counts too
        sink.put(ended_group(cfg, limit))
        assert sink.pending() == limit and sampler._held_back()
        before = sampler.groups_started
        sampler._feed(sampler)
        assert sampler.groups_started == before  # no group starts while they wait
        reward.release.set()
        wait_for(lambda: sink.pending() == 0, 30, "the sink to score and send the groups")
        assert client.sent == limit and not sampler._held_back()
    finally:
        reward.release.set()
        sink.close()


def test_a_group_left_out_no_longer_counts_toward_the_versions_cap(small_cfg):
    """Synchronous GRPO (sampler.max_groups_per_version): a group the sink left out (an environment or a reward
    failed) still counted toward the version's cap, so the sampler waited for the next version while the trainer
    waited for the step's missing group: both for ever. A group of an older version frees nothing."""
    cfg = small_cfg.model_copy(update={"sampler": small_cfg.sampler.model_copy(update={"max_groups_per_version": 2})})
    client = Client()
    sampler = feeder(cfg, client, None, [])
    sink = GroupSink(client, SamplerMetrics("s"), types.SimpleNamespace(decode=lambda ids: "1"), "s", 0.0,
                     lambda: False, types.SimpleNamespace(close=lambda: None), left_out=sampler._left_out)
    sampler.sink = sink
    try:
        sampler.weights.groups_at_version = 2
        assert sampler._held_back()
        older, failed = ended_group(cfg, 0), ended_group(cfg, 1)
        older.version_at_start, failed.version_at_start = 2, 3  # the older one was not one of version 3's 2
        for run in (older, failed):
            run.work.rewards = None
            run.results[1] = EpisodeResult(failed="the environment's start raised KeyError")
            sink.put(run)
        wait_for(lambda: sink.groups_failed == 2, 10, "the sink to leave both groups out")
        assert not sampler._held_back()
        sampler._feed(sampler)
        assert sampler.groups_started == 1  # the one group the version still owes the trainer
        sampler.weights.groups_at_version += 1
        assert sampler._held_back()
    finally:
        sink.close()


def test_a_group_the_ingest_refused_no_longer_counts_toward_the_versions_cap(small_cfg):
    """A group the ingest refuses as invalid (the rollout client's `lost`, told its starting version) never reaches
    the trainer either: counted toward the version's cap, it held a synchronous sampler as a left-out one did."""
    cfg = small_cfg.model_copy(update={"sampler": small_cfg.sampler.model_copy(update={"max_groups_per_version": 2})})
    sampler = feeder(cfg, Client(), types.SimpleNamespace(pending=lambda: 0), [])
    sampler.weights.groups_at_version = 2
    assert sampler._held_back()
    sampler._lost_at_version(2)  # an older version's: frees nothing
    assert sampler._held_back()
    sampler._lost_at_version(3)
    assert not sampler._held_back() and sampler._version_allows() == 1


def test_one_feed_starts_no_more_groups_than_the_versions_cap_allows(small_cfg):
    """The cap was checked before a feed only: with room for 4 groups and a cap of 2 (none started yet) one feed
    started 4, twice the version's share of the step (with admission off, the extra ones are made to be dropped as
    stale)."""
    cfg = small_cfg.model_copy(update={"sampler": small_cfg.sampler.model_copy(update={"max_groups_per_version": 2})})
    sampler = feeder(cfg, Client(), types.SimpleNamespace(pending=lambda: 0), [])
    sampler._feed(sampler)
    assert sampler.groups_started == 2 and sampler.stream.room(16, 16) == 8


def test_an_error_the_sink_meets_while_it_finishes_at_the_final_version_stops_the_sampler(small_cfg):
    """At the final version (or SIGTERM) the feeder closes the sink, which finishes the groups handed over; what it
    raised then was kept and never raised, so the sampler ended cleanly with those groups lost."""
    cancelled = threading.Event()

    class ScoresWhileStopping:
        def call(self, name, fn, text, reference):
            cancelled.wait(10)  # scored while the feeder stops (once it cancelled the stream)
            return 1.0

        def close(self):
            pass

    class FailingClient(Client):  # a bug met sending (a reward that raises only fails its group: test_group_sink)
        def put(self, message, timeout_s, epoch="", evaluation_only=False, started_at=-1):
            raise ValueError("sink bug")

    class Engine:
        side = None

        def request_keys(self, rng, n):
            return [None] * n

        def serve(self, params, stream, refresh, version):
            while not stream.cancelled():
                stream.wait(0.05)

    sink = GroupSink(FailingClient(), SamplerMetrics("s"), types.SimpleNamespace(decode=lambda ids: "1"), "s", 0.0,
                     lambda: False, ScoresWhileStopping())
    sampler = Sampler.__new__(Sampler)
    sampler.stop_event, sampler.sink, sampler.run_dir, sampler.sampler_id = threading.Event(), sink, None, "s"

    def stream_started(stream, side):
        if stream is not None:  # the reward's wait ends when the feeder cancels the stream
            original = stream.cancel
            stream.cancel = lambda: (original(), cancelled.set())
    sampler.weights = types.SimpleNamespace(
        final=False, stream_started=stream_started, staged=types.SimpleNamespace(refresh=lambda: None),
        installed=lambda: (None, 0), poll_due=lambda: False, report_installed=lambda: None,
        final_reached=lambda: True, install_final=lambda: True)
    parts = types.SimpleNamespace(engine=Engine(), client=Client())
    parts.client.check = lambda: None
    sink.put(ended_group(small_cfg, 0))
    with pytest.raises(ValueError, match="sink bug"):
        sampler._stream_until_done(parts)


def test_a_group_handed_to_the_sink_while_the_feeder_counts_is_still_counted(small_cfg):
    """The feeder read the sink's count before the stream's groups in flight: a group whose last episode ended between
    the two reads was in neither, and the in_flight it told Admit was one short (the ingest over-granted). Read
    upstream first, a group that moves on meanwhile is counted twice at worst (a grant one smaller, never larger)."""
    admitted, handed = [], []
    sampler = feeder(small_cfg, Client(), None, admitted)
    sampler._held_back = lambda: False  # only the count reported to Admit reads the sink here
    sampler.stream = RolloutStream(lambda rng, n: [None] * n, handed.append)
    run = sampler.stream.start(ended_group(small_cfg, 0).work, types.SimpleNamespace(start=lambda run: None))

    def pending_then_the_group_ends() -> int:
        count = len(handed)
        for row in range(run.work.rows if not handed else 0):  # on another thread in a sampler: just after the read
            run.episode_done(row, EpisodeResult(tokens=[1], finished=True))
        return count

    sampler.sink = types.SimpleNamespace(pending=pending_then_the_group_ends)
    sampler._feed(sampler)
    assert handed == [run] and admitted and admitted[0] >= 1


def test_a_group_the_sink_sends_while_the_feeder_counts_still_holds_the_backlog(small_cfg):
    """_held_back read the client's count before the sink's: a scored group put on the backlog between the two reads
    was in neither, and one group more than sampler.backlog_max_groups could start."""
    limit = small_cfg.sampler.backlog_max_groups
    sink = types.SimpleNamespace(scored=limit)
    sink.pending = lambda: sink.scored

    class SentAsItIsRead(Client):
        """The sink's thread puts a scored group on the backlog just after the feeder read the client's count."""

        @property
        def unacked(self) -> int:
            count = self.sent
            if sink.scored:
                sink.scored -= 1
                self.sent += 1
            return count

        @unacked.setter
        def unacked(self, value: int) -> None:
            self.sent = value

    sampler = feeder(small_cfg, SentAsItIsRead(), sink, [])
    assert sampler._held_back()


def test_an_engine_that_fails_while_the_feeder_waits_for_admission_stops_the_sampler_with_its_own_error(small_cfg):
    """The feeder spends its time in Admit (an RPC, a refusal's wait): an engine that failed meanwhile cancelled the
    stream, the group admitted then could not start ("the rollout stream is closed"), and that error, not the
    engine's, ended the sampler (a PermanentError lost, so `up` restarted a sampler no restart helps)."""
    failed, broke = threading.Event(), threading.Event()

    class Engine:
        side = None

        def request_keys(self, rng, n):
            return [None] * n

        def serve(self, params, stream, refresh, version):
            failed.wait(30)
            raise PermanentError("the weights are another model's")

    def admit(wanted, version, holding):
        failed.set()
        wait_for(broke.is_set, 30, "the engine's thread to fail and cancel the stream")
        return wanted

    sampler = feeder(small_cfg, Client(), types.SimpleNamespace(pending=lambda: 0, check=lambda: None, put=None,
                                                                close=lambda: None), [])
    sampler.stop_event, sampler.run_dir, sampler.sampler_id = threading.Event(), None, "s"
    sampler.admission = types.SimpleNamespace(admit=admit)
    sampler._report_throughput = lambda: None
    sampler.weights = types.SimpleNamespace(**vars(sampler.weights), stream_started=lambda stream, side: None,
                                            installed=lambda: (None, 0), poll_due=lambda: False,
                                            report_installed=lambda: None, final_reached=lambda: False, final=False)
    sampler.weights.staged.refresh = lambda: None
    parts = types.SimpleNamespace(engine=Engine(), client=sampler.client,
                                  metrics=types.SimpleNamespace(backlog=types.SimpleNamespace(set=lambda n: None)))
    parts.client.check = lambda: None
    cancel = RolloutStream.cancel

    def cancel_and_tell(stream):
        cancel(stream)
        broke.set()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RolloutStream, "cancel", cancel_and_tell)
        with pytest.raises(PermanentError, match="another model"):
            sampler._stream_until_done(parts)


def test_an_evaluation_only_group_does_not_count_toward_the_versions_cap(small_cfg):
    """Synchronous GRPO (sampler.max_groups_per_version): an injected train=false prompt's group is answered, never
    trained, yet it took one of the version's places, so the step was one group short: the trainer waited for it and
    the sampler for the next version, both for ever. Nor does it free a place when the sink leaves it out."""
    cfg = small_cfg.model_copy(update={"sampler": small_cfg.sampler.model_copy(update={"max_groups_per_version": 2})})
    sampler = feeder(cfg, Client(), types.SimpleNamespace(pending=lambda: 0), [])
    weights = sampler.weights
    weights.group_started = lambda: setattr(weights, "groups_at_version", weights.groups_at_version + 1)
    g = cfg.generation.num_generations
    evaluation = GroupWork(types.SimpleNamespace(prompt_id="eval", answer="", prompt=""), [1, 2], g,
                           RewardSet(cfg.task.rewards), "run/inj/eval", None, None, train=False)
    works = iter([evaluation] + [ended_group(cfg, i).work for i in range(10)])
    sampler.source.next_groups = lambda groups, rows, version: [next(works) for _ in range(min(groups, rows // g))]
    trained = []
    start = sampler.stream.start
    sampler.stream.start = lambda work, kind, version=0: (trained.append(work.train), start(work, kind, version))[1]
    for _ in range(3):
        sampler._feed(sampler)
    assert trained.count(True) == 2 and weights.groups_at_version == 2, trained  # the version's share, all trained
    sampler._left_out(types.SimpleNamespace(work=evaluation, version_at_start=3))
    assert sampler._version_allows() == 0


def test_at_the_final_version_the_sink_stops_offering_groups_to_a_full_backlog(tiny_parts, caplog):
    """The feeder stops its stream once the trainer's final version is fetched and closes the sink before it installs
    that version, so the sink's `abandon` (a stop, or the final version installed) still read False: beside a full
    backlog (an ingest that refuses more, or a trainer that has gone) every sampler's end waited out the sink's close
    and said groups were left out, for groups the trainer could never train."""
    from grpo_stream.sampler_service.connect import Resume  # noqa: PLC0415

    cfg, task, tokenizer, _ = tiny_parts

    class FullBacklog(Client):
        def put(self, message, timeout_s, epoch="", evaluation_only=False, started_at=-1):
            return False

    sampler = Sampler(cfg, 0)
    parts = types.SimpleNamespace(sync=None, client=FullBacklog(), admission=None, ingest_stub=None, task=task,
                                  resume=Resume(), tokenizer=tokenizer, rewards=RewardSet(cfg.task.rewards),
                                  metrics=SamplerMetrics("s"))
    sampler._attach(parts, None)
    sampler.weights.staged.stage(types.SimpleNamespace(version=4, final=True, params=None))  # fetched, not installed
    assert sampler.weights.final_reached() and not sampler.weights.final
    run = ended_group(cfg, 0)
    run.work.rewards = types.SimpleNamespace(score=lambda text, answer, call: (1.0, {}))
    sampler.sink.put(run)
    with caplog.at_level("WARNING"):
        sampler._close_kinds_and_sink()
    assert not sampler.sink._given_up and "left out" not in caplog.text
