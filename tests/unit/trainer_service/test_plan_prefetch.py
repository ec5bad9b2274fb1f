"""Plans made ahead (trainer.prefetch_plans): process 0's source makes step n+1's plan on the prefetch thread while
the core applies step n, for the step that trains it (staleness against version n), packed; a stop while the prefetch
waits for groups, or after it made a plan, ends it before the finish plan and leaves its groups in the buffer; its
errors reach the main thread; a heartbeat only while the main thread waits for the plan; followers receive and pack
the next plan ahead, in order. Over the in-memory buffer with a stand-in core (logic only: the real trainer's crash
and resume with a prefetched plan run in tests/integration/test_trainer_resume.py)."""

import dataclasses
import threading
import time
import types

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.redis_errors import BufferUnavailable
from grpo_stream.common.rollouts.registry import open_buffer
from grpo_stream.common.rollouts.wire import decode_group
from grpo_stream.common.runtime.heartbeat import seconds_since_beat
from grpo_stream.trainer_service.core import StepResult
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.collector import GroupCollector
from grpo_stream.trainer_service.loop import LeaderServices
from grpo_stream.trainer_service.plan_prefetch import PlanPrefetch
from grpo_stream.trainer_service.plan_sources import FollowerSource, LeaderSource, drive
from grpo_stream.trainer_service.plans import FinishPlan, StartPlan, StepPlan, to_message
from grpo_stream.trainer_service.control_messages import ControlMessageError
from tests.conftest import CONFIGS
from tests.unit.trainer_service.learning.test_collector import LIMITS, group
from tests.unit.trainer_service.test_multihost import Store
from tests.unit.trainer_service.test_multihost import group as trainer_group

WAIT_S = 20.0  # the longest a test waits for the other thread (a loaded machine), never on a passing run


def config(steps: int, prefetch: bool = True):
    return load_config(CONFIGS / "tiny_arith.yaml", [
        f"trainer.steps={steps}", "trainer.groups_per_step=2", "trainer.max_staleness=0",
        f"trainer.prefetch_plans={str(prefetch).lower()}", "checkpoint.every=100"])


class Checkpoints:
    def steps(self):
        return []


def packed_of(batch):
    """The stand-in core's packing: something the plan must carry to the core unchanged."""
    return ("packed", int(np.asarray(batch.valid).sum()))


class Core:
    """Applies plans as TrainerCore would be asked to: records each step plan, its thread and its groups; `during`
    runs inside a step's apply (the update's time, when the prefetch works)."""

    def __init__(self, source, during=None):
        self.source, self.during = source, during or {}
        self.applied, self.finish = [], None
        self.progress = None

    def apply(self, plan):
        if isinstance(plan, StartPlan):
            return 0
        if isinstance(plan, StepPlan):
            assert plan.packed == packed_of(plan.batch)  # the core packs nothing: the plan came packed
            self.applied.append((plan.step, [g.group_id for _, g in self.source._context[plan.step].picked]))
            if plan.step in self.during:
                self.during[plan.step]()
            return StepResult({}, {"publish_wait_seconds": 0.0, "compute_seconds": 0.01, "handoff_seconds": 0.0})
        if isinstance(plan, FinishPlan):
            self.finish = (plan, [t.name for t in threading.enumerate() if t.name == "plan-prefetch"])
        return None


def leader(tmp_path, cfg, incoming, stop=None):
    """A LeaderSource over the in-memory buffer holding `incoming`, whose collector records each call's step and
    thread (`calls`, `collected`: set when it returned)."""
    buffer = open_buffer(None, "memory")
    buffer.append_many(incoming, max_groups=100)
    stop = stop or threading.Event()
    s = LeaderServices(epoch="e", stop_event=stop, buffer=buffer, checkpoints=Checkpoints(),
                       status=types.SimpleNamespace(step=0))
    source = LeaderSource(cfg, tmp_path, s)
    s.collector = GroupCollector(buffer, 2, cfg.trainer.max_staleness, None, stop, lambda: 0, limits=LIMITS,
                                 waiting=source.collector_waiting)
    source.pack = packed_of
    source.await_samplers = lambda version: None  # no samplers here
    calls, collected, collect = [], {}, s.collector.collect

    def recorded(step, cancel=None):
        calls.append((step, threading.current_thread().name))
        out = collect(step, cancel)
        collected.setdefault(step, threading.Event()).set()
        return out

    s.collector.collect = recorded
    return source, buffer, calls, collected


def wait_for(events: dict, step: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while step not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events[step].wait(WAIT_S), f"step {step} was never collected"


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_next_plan_is_made_during_this_update_for_the_step_that_trains_it(tmp_path, prefetch):
    # step 1 trains version 0; with max_staleness 0, step 2 trains version 1 only: the two version-0 groups after
    # step 1's are stale for it, though read while step 1 computes (the trainer still at version 0)
    incoming = [group(0, 0), group(1, 0), group(2, 0), group(3, 0), group(4, 1), group(5, 1)]
    source, buffer, calls, collected = leader(tmp_path, config(2, prefetch), incoming)
    seen_during_update = []
    core = Core(source, during={1: lambda: seen_during_update.append(
        collected.get(2) is not None or (prefetch and wait_for(collected, 2) is None))})
    drive(source, core, tmp_path, "trainer-0")
    assert core.applied == [(1, ["run/s0/0", "run/s0/1"]), (2, ["run/s0/4", "run/s0/5"])]
    assert {k: (v["outcome"], v["step"]) for k, v in buffer.settled.items()} == {
        "run/s0/2": ("dropped_stale", 2), "run/s0/3": ("dropped_stale", 2)}
    assert calls == [(1, "MainThread"), (2, "plan-prefetch" if prefetch else "MainThread")]
    assert seen_during_update == [prefetch]  # made while step 1 was applied, or after it
    ahead = [t["prepared_ahead"] for t in source.step_times]
    assert ahead == ([0.0, 1.0] if prefetch else [0.0, 0.0])
    for t in source.step_times:  # the main thread's phases, and the plan's making wherever it ran
        assert {"plan_wait_seconds", "collect_seconds", "batch_seconds", "pack_seconds", "step_seconds"} <= set(t)
    assert source.tokens["padded_laid_out"] == 2 * 2 * 2 * 42  # two steps of two groups of two rows
    assert core.finish[0].steps == 2 and core.finish[0].complete and core.finish[1] == []


def test_a_stop_while_the_prefetch_waits_for_groups_ends_it_before_the_finish_plan(tmp_path):
    stop = threading.Event()
    source, buffer, calls, _ = leader(tmp_path, config(3), [group(0, 0), group(1, 0), group(2, 1)], stop)
    core = Core(source, during={1: lambda: threading.Timer(0.3, stop.set).start()})
    started = time.monotonic()
    drive(source, core, tmp_path, "trainer-0")
    assert time.monotonic() - started < WAIT_S
    assert core.applied == [(1, ["run/s0/0", "run/s0/1"])] and calls == [(1, "MainThread"), (2, "plan-prefetch")]
    finish, prefetching = core.finish
    assert (finish.steps, finish.complete, prefetching) == (1, False, [])  # the prefetch had ended
    # the group it read for step 2 stays the collector's, unsettled in the buffer
    assert [g.group_id for _, g in source.s.collector.pending] == ["run/s0/2"] and buffer.counters()["depth"] == 3


def test_a_plan_made_ahead_but_stopped_before_its_step_leaves_its_groups_to_be_read_again(tmp_path):
    stop = threading.Event()
    incoming = [group(i, 0 if i < 2 else 1) for i in range(6)]
    source, buffer, calls, collected = leader(tmp_path, config(3), incoming, stop)
    core = Core(source, during={1: lambda: (wait_for(collected, 2), stop.set())})  # step 2's plan made, then a stop
    drive(source, core, tmp_path, "trainer-0")
    assert core.applied == [(1, ["run/s0/0", "run/s0/1"])] and core.finish[0].steps == 1
    assert (2, "plan-prefetch") in calls and buffer.counters()["depth"] == 6 and not buffer.settled
    buffer.redeliver()  # a restarted trainer reads what was read and not settled, in stream order
    again = [decode_group(e.payload).group_id for e in buffer.read(10, 10)]
    assert again == [f"run/s0/{i}" for i in range(6)]


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_stop_while_redis_is_down_and_dropped_groups_wait_to_be_settled_still_ends_with_the_finish_plan(
        tmp_path, prefetch):
    # step 1 reads all four version-0 groups; step 2 (version 1 held, max_staleness 0) finds the two it did not take
    # stale, and settling them meets Redis away while the run is asked to stop: the collection gives up
    # (StopRequested), which, raised, failed the run before the finish plan and its checkpoint of step 1
    stop = threading.Event()
    source, buffer, calls, _ = leader(tmp_path, config(3, prefetch), [group(i, 0) for i in range(4)], stop)

    def redis_down(records):
        stop.set()
        raise BufferUnavailable("Error 111 connecting to localhost:6379. Connection refused.")

    buffer.settle = redis_down
    core = Core(source)
    drive(source, core, tmp_path, "trainer-0")
    assert core.applied == [(1, ["run/s0/0", "run/s0/1"])]
    assert (2, "plan-prefetch" if prefetch else "MainThread") in calls
    finish, prefetching = core.finish
    assert (finish.steps, finish.complete, prefetching) == (1, False, [])
    # the stale groups stay in the buffer, unsettled, and in the collector's hands
    assert [g.group_id for _, g in source.s.collector.pending] == ["run/s0/2", "run/s0/3"]
    assert not buffer.settled and buffer.counters()["depth"] == 4


def test_an_error_of_the_prefetch_thread_is_raised_on_the_main_thread(tmp_path):
    source, _, _, _ = leader(tmp_path, config(3), [group(i, 0) for i in range(2)] + [group(i, 1) for i in range(2, 6)])
    collect = source.s.collector.collect

    def failing(step, cancel=None):
        if step == 2:
            raise RuntimeError("decoding failed on the prefetch thread")
        return collect(step, cancel)

    source.s.collector.collect = failing
    core = Core(source)
    with pytest.raises(RuntimeError, match="decoding failed on the prefetch thread"):
        drive(source, core, tmp_path, "trainer-0")
    assert core.applied == [(1, ["run/s0/0", "run/s0/1"])]


def test_a_failed_update_cancels_the_prefetch_waiting_for_groups(tmp_path):
    source, _, calls, _ = leader(tmp_path, config(3), [group(0, 0), group(1, 0)])

    def fail():
        deadline = time.monotonic() + WAIT_S  # the prefetch of step 2 is waiting for groups that never come
        while (2, "plan-prefetch") not in calls and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("the update failed")

    with pytest.raises(ValueError, match="the update failed"):
        drive(source, Core(source, during={1: fail}), tmp_path, "trainer-0")
    source.close()
    assert source.prefetch.cancel.is_set()
    for thread in [t for t in threading.enumerate() if t.name == "plan-prefetch"]:
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_the_collector_beats_only_while_the_main_thread_waits_for_its_plan(tmp_path):
    source, _, _, _ = leader(tmp_path, config(3), [])
    source.prefetch = PlanPrefetch(lambda step, cancel: None, True)
    source.collector_waiting()  # the main thread is in an update (which may hang): no beat
    assert seconds_since_beat(tmp_path, "trainer-0") is None
    source.prefetch.main_waits = True
    source.collector_waiting()
    assert seconds_since_beat(tmp_path, "trainer-0") is not None


def step_message(cfg, step: int, batch):
    kind, fields, arrays = to_message(StepPlan(step=step, batch=batch, checkpoint=False, publish=True, final=False))
    return kind, fields, {k: np.asarray(v) for k, v in arrays.items()}


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_follower_takes_process_0s_plans_in_order_packed(prefetch):
    cfg = config(3, prefetch)
    groups = [decode_group(g.payload) for g in (group(0, 0), group(1, 0))]
    batch, _ = build_batch(groups, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, 0, cfg.algo,
                           held_version=0)
    store = Store()
    sender = trainer_group(0, store)
    sender.send("start", {"epoch": "e", "restore": None})
    for step in (1, 2, 4):  # step 3 is missing: the follower refuses 4 after 2
        sender.send(*step_message(cfg, step, batch))
    follower = FollowerSource(cfg, trainer_group(1, store))
    follower.pack = packed_of
    plans = iter(follower)
    follower.applied(next(plans), 0)
    for step in (1, 2):
        plan = next(plans)
        assert plan.step == step and plan.packed == packed_of(batch)
        _, fields, arrays = to_message(plan)  # what process 0 sends carries no packing
        assert "packed" not in fields and set(arrays) == {f.name for f in dataclasses.fields(batch)}
        follower.applied(plan, StepResult({}, {}))
    with pytest.raises(ControlMessageError, match="process 0 sent step 4 after step 2"):
        next(plans)
