"""A stop while an evaluation during RL runs (in_run_eval.py: InRunEvaluator.close): the running evaluation ends at
its next progress call, recorded as skipped and not as an error, and the process's exit waits for it. Before, close
only lifted the pauses: the evaluation computed on, on a daemon thread, while the trainer exited, and XLA work on a
thread at interpreter shutdown aborted the process (SIGABRT, SIGSEGV) after a clean stop."""

import os
import pathlib
import subprocess
import sys
import threading

import pytest

from grpo_stream.trainer_service.reports.in_run_eval import DutyCycle, EvaluationCancelled, InRunEvaluator

ROOT = pathlib.Path(__file__).resolve().parents[4]
RESULT = {"accuracy": 0.5, "format_rate": 1.0, "reward": 0.5, "num_problems": 4, "seconds": 0.1}


def test_close_cancels_the_running_evaluation_at_its_next_progress_call():
    started, go, went_on, recorded = threading.Event(), threading.Event(), [], []

    def evaluate(step, params, progress):
        started.set()
        assert go.wait(30)
        progress()  # a group ended: closed meanwhile, the evaluation ends here
        went_on.append(step)
        return RESULT

    ev = InRunEvaluator(evaluate, lambda step, result: recorded.append(step))
    ev.submit(2, None)
    assert started.wait(30)
    ev.submit(4, None)
    ev.close()
    go.set()
    assert ev.drain(30) and ev.join(30)
    assert went_on == [] and recorded == [] and ev.errors == 0
    state = ev.state()
    assert state["eval_skipped"] == [4, 2] and state["eval_curve"] == [] and state["eval_errors"] == 0


def test_a_cancelled_duty_cycle_ends_a_pause_and_raises():
    now = [0.0]
    cycle = DutyCycle(0.01, clock=lambda: now[0])
    now[0] = 1000.0  # computed 1000 s since the start: the next call pauses for 99,000 s, until the cancel
    threading.Timer(0.05, cycle.cancel).start()
    with pytest.raises(EvaluationCancelled):
        cycle()
    with pytest.raises(EvaluationCancelled):  # and every later call
        cycle()


SCRIPT = """
import threading
import jax, jax.numpy as jnp
from grpo_stream.trainer_service.reports.in_run_eval import InRunEvaluator
step = jax.jit(lambda x: jnp.tanh(x @ x))
started = threading.Event()

def evaluate(version, params, progress):
    x = jnp.ones((400, 400))
    for _ in range(5000):  # an evaluation's batches, a progress call as each group ends
        x = step(x)
        x.block_until_ready()
        started.set()
        progress()
    return {}

ev = InRunEvaluator(evaluate, lambda step, result: None)
ev.submit(2, None)
assert started.wait(60)
ev.close()  # the run stopped: the trainer exits now
print("exiting")
"""


def test_a_process_that_closes_a_running_evaluation_exits_cleanly():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "exiting" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
