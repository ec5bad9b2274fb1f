"""Scheduling of evaluation during RL (in_run_eval.py): which versions get evaluated when evaluation is slower than
training (one runs, one waits, a newer due version replaces the waiting one), errors counted not raised, the duty
cycle of eval.max_share."""

import threading

import pytest

from grpo_stream.trainer_service.reports.in_run_eval import DutyCycle, InRunEvaluator, metric_values

RESULT = {"accuracy": 0.5, "format_rate": 1.0, "reward": 0.5, "num_problems": 4, "seconds": 0.1,
          "pass_at_k": {"1": 0.4, "4": 0.7}, "maj_at_k": {"4": 0.6}, "task_metrics": {"prompt_level_strict_acc": 0.3},
          "reward_components": {"answer_correct": 0.5}, "failed_episodes": 0, "sampled_reward": 0.45,
          "sampled_reward_components": {"answer_correct": 0.4}}


class Gate:
    """A fake evaluation: records what it was given, blocks each step until released, raises for `fail`."""

    def __init__(self, fail=()):
        self.started, self.released, self.fail = [], {}, set(fail)
        self.lock = threading.Lock()
        self.began = threading.Condition(self.lock)

    def __call__(self, step, params, progress):
        with self.lock:
            self.started.append((step, params))
            gate = self.released.setdefault(step, threading.Event())
            self.began.notify_all()
        assert gate.wait(10), f"step {step} never released"
        progress()
        if step in self.fail:
            raise RuntimeError(f"evaluation of {step} broke")
        return {**RESULT, "accuracy": step / 100}

    def wait_started(self, step):
        with self.lock:
            assert self.began.wait_for(lambda: any(s == step for s, _ in self.started), 10)

    def release(self, step):
        with self.lock:
            self.released.setdefault(step, threading.Event()).set()


def test_slower_than_training_the_newest_due_version_replaces_the_waiting_one():
    gate, recorded = Gate(), []
    ev = InRunEvaluator(gate, lambda step, result: recorded.append((step, result["accuracy"])))
    ev.submit(2, "w2")
    gate.wait_started(2)
    for step in (4, 6, 8):  # training goes on while version 2 is evaluated: 4 waits, then 6 replaces it, then 8
        ev.submit(step, f"w{step}")
    assert ev.pending() == [2, 8]
    assert ev.skipped == [4, 6]
    gate.release(2)
    gate.wait_started(8)
    gate.release(8)
    assert ev.drain(10)
    assert [s for s, _ in gate.started] == [2, 8] and [p for _, p in gate.started] == ["w2", "w8"]
    assert recorded == [(2, 0.02), (8, 0.08)]
    state = ev.state()
    assert [r["step"] for r in state["eval_curve"]] == [2, 8] and state["eval_skipped"] == [4, 6]
    assert state["eval_curve"][0]["pass_at_k"] == {"1": 0.4, "4": 0.7} and "examples" not in state["eval_curve"][0]
    ev.close()


def test_keeping_up_evaluates_every_due_version():
    gate, recorded = Gate(), []
    ev = InRunEvaluator(gate, lambda step, result: recorded.append(step))
    for step in (2, 4, 6):
        gate.release(step)
        ev.submit(step, None)
        assert ev.drain(10)
    assert recorded == [2, 4, 6] and ev.skipped == []
    ev.close()


def test_an_evaluation_error_is_counted_and_the_next_one_runs():
    gate, recorded = Gate(fail={4}), []
    ev = InRunEvaluator(gate, lambda step, result: recorded.append(step))
    for step in (2, 4, 6):
        gate.release(step)
        ev.submit(step, None)
        assert ev.drain(10)
    assert recorded == [2, 6] and ev.errors == 1 and ev.state()["eval_errors"] == 1


def test_a_system_exit_in_an_evaluation_is_counted_and_the_thread_goes_on():
    # code the evaluation runs (a reward function, an environment) calling sys.exit used to end the thread with
    # the version still running: drain() never returned, so the trainer's end waited for ever
    def evaluate(step, params, progress):
        if step == 2:
            raise SystemExit("an environment called sys.exit")
        return {**RESULT, "accuracy": step / 100}

    recorded = []
    ev = InRunEvaluator(evaluate, lambda step, result: recorded.append(step))
    ev.submit(2, None)
    assert ev.drain(10) and ev.errors == 1 and ev.pending() == []
    ev.submit(4, None)
    assert ev.drain(10) and recorded == [4]
    ev.close()


def test_a_failing_record_is_counted_too():
    gate = Gate()
    gate.release(2)

    def record(step, result):
        raise OSError("disk full")

    ev = InRunEvaluator(gate, record)
    ev.submit(2, None)
    assert ev.drain(10) and ev.errors == 1


def test_close_drops_the_waiting_version_and_refuses_more():
    gate = Gate()
    ev = InRunEvaluator(gate, lambda step, result: None)
    ev.submit(2, None)
    gate.wait_started(2)
    ev.submit(4, None)
    ev.close()
    gate.release(2)
    assert ev.drain(10) and ev.skipped == [4]
    with pytest.raises(RuntimeError, match="closed"):
        ev.submit(6, None)


def test_resumed_curve_is_kept_and_known():
    ev = InRunEvaluator(Gate(), lambda step, result: None, curve=[{"step": 4, "when": "during"}])
    assert ev.evaluated(4) and not ev.evaluated(2)


def test_a_record_counts_the_versions_still_pending_as_skipped():
    """A checkpoint saved (or a stopped run's summary written) while versions are running or waiting: a trainer
    resumed from it never evaluates them, so they are listed as skipped, not lost from both lists; one that ends
    here is in the next record's curve instead."""
    gate = Gate()
    ev = InRunEvaluator(gate, lambda step, result: None)
    ev.submit(2, None)
    gate.wait_started(2)
    ev.submit(4, None)
    assert ev.state()["eval_curve"] == [] and ev.state()["eval_skipped"] == [2, 4]
    gate.release(2)
    gate.wait_started(4)
    state = ev.state()
    assert [r["step"] for r in state["eval_curve"]] == [2] and state["eval_skipped"] == [4]
    gate.release(4)
    assert ev.drain(10)
    state = ev.state()
    assert [r["step"] for r in state["eval_curve"]] == [2, 4] and state["eval_skipped"] == [] and ev.skipped == []
    ev.close()


def test_a_resumed_evaluator_takes_a_version_it_evaluates_again_off_the_skipped_list():
    gate = Gate()
    ev = InRunEvaluator(gate, lambda step, result: None)
    ev.skipped = [2, 4]  # the checkpoint's record: 4, the step restored, was pending when it was saved
    ev.submit(4, None)
    gate.release(4)
    assert ev.drain(10)
    state = ev.state()
    assert [r["step"] for r in state["eval_curve"]] == [4] and state["eval_skipped"] == [2]
    ev.close()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class RecordingEvent(threading.Event):
    def __init__(self, clock):
        super().__init__()
        self.clock, self.waits = clock, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        self.clock.now += timeout or 0.0
        return self.is_set()


def test_duty_cycle_pauses_for_the_rest_of_its_share():
    clock = FakeClock()
    released = RecordingEvent(clock)
    cycle = DutyCycle(0.2, released, clock)
    clock.now += 1.0  # computed 1 s: at a share of 0.2 it pauses 4 s
    cycle()
    clock.now += 0.5
    cycle()
    assert released.waits == pytest.approx([4.0, 2.0])
    assert cycle.paused_s == pytest.approx(6.0)
    cycle.release()
    clock.now += 1.0
    cycle()  # released: no more pauses (the end of the run)
    assert len(released.waits) == 2


def test_a_pause_a_release_ends_early_counts_what_it_waited():
    clock = FakeClock()

    class ReleasedMidway(RecordingEvent):
        def wait(self, timeout=None):  # the run ends 1 s into a 4 s pause
            self.waits.append(timeout)
            self.clock.now += 1.0
            return True
    cycle = DutyCycle(0.2, ReleasedMidway(clock), clock)
    clock.now += 1.0
    cycle()
    assert cycle.paused_s == pytest.approx(1.0)


def test_duty_cycle_of_one_never_pauses():
    clock = FakeClock()
    released = RecordingEvent(clock)
    cycle = DutyCycle(1.0, released, clock)
    clock.now += 3.0
    cycle()
    assert released.waits == []


def test_metric_values_flatten_every_figure():
    values = metric_values(RESULT)
    assert values["pass_at_1"] == 0.4 and values["pass_at_4"] == 0.7 and values["maj_at_4"] == 0.6
    assert values["task/prompt_level_strict_acc"] == 0.3 and values["reward/answer_correct"] == 0.5
    assert values["accuracy"] == 0.5 and values["sampled_reward"] == 0.45
    assert values["sampled_reward/answer_correct"] == 0.4  # each reward's mean over the sampled completions too
    assert all(isinstance(v, float) for v in values.values())
