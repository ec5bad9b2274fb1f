"""A trainer that failed while a background job of its core is stuck (a publication whose transfer never ends, a
step report a tracker holds, books waiting for Redis) still exits with its error. Before, those jobs ran on
ThreadPoolExecutor workers, which the interpreter joins at exit whatever `shutdown(wait=False)` said: the process
logged its error and then hung for ever, and a supervisor that only restarts exited jobs never restarted it."""

import subprocess
import sys
import threading

import pytest

from grpo_stream.trainer_service.daemon_worker import DaemonWorker
from tests.conftest import ROOT

# run as its own process: what is tested is that the process ends
SCRIPT = """
import os, pathlib, sys, threading
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service import core as core_module
from grpo_stream.trainer_service.plans import StartPlan
from tests.conftest import CONFIGS
from tests.unit.trainer_service.test_trainer_core import SMALL_CORE, batches, new_core, step

cfg = load_config(CONFIGS / "tiny_arith.yaml", [*SMALL_CORE, "trainer.eval_before=false", "trainer.eval_after=false"])
core, keeper = new_core(cfg, pathlib.Path(sys.argv[1]))
data = batches(cfg, core.parts.tokenizer.vocab_size)
core.apply(StartPlan(epoch="e", restore=None, warm_start=False, export_warm=False, eval_before=False))
never, stuck, inner = threading.Event(), [], core.publisher.sink.put

def stuck_put(version, named, *args, **kwargs):
    if version == 1:  # a transfer that never ends
        stuck.append(threading.current_thread())
        never.wait()
    return inner(version, named, *args, **kwargs)

core.publisher.sink.put = stuck_put
core_module.BACKGROUND_WAIT_S = 0.5
core.apply(step(1, data[0], publish=True))
try:
    core.apply(step(2, data[1]))
except TimeoutError as exc:
    print("step 2 failed:", exc, flush=True)
keeper.checkpoints.close()
core.close(failed=True)
if not stuck[0].daemon:  # the interpreter's exit would wait for it: say so rather than hang
    print(f"exit would wait for the stuck thread {stuck[0].name}", flush=True)
    os._exit(3)
print("closed", flush=True)
"""


def test_a_failed_core_with_a_stuck_publication_lets_the_process_exit(tmp_path):
    # the timeout only guards the test run against the hang this fixes; the process ends right after "closed"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    out = done.stdout + done.stderr[-3000:]
    assert "step 2 failed: " in done.stdout and "did not end" in done.stdout, out
    assert done.returncode == 0 and "closed" in done.stdout, out


def test_the_worker_runs_jobs_in_order_and_a_shutdown_without_waiting_leaves_a_stuck_one_to_a_daemon():
    worker, entered, never, done = DaemonWorker("test-worker"), threading.Event(), threading.Event(), []

    def fail():
        raise ValueError("job failed")

    first, failed = worker.submit(done.append, 1), worker.submit(fail)
    stuck = worker.submit(lambda: (entered.set(), never.wait()))
    queued = worker.submit(done.append, 2)
    try:
        assert first.result(60) is None and isinstance(failed.exception(60), ValueError)
        assert entered.wait(60)
        worker.shutdown(wait=False, cancel_futures=True)
        assert queued.cancelled() and not stuck.done() and done == [1]
        assert [t.daemon for t in threading.enumerate() if t.name == "test-worker"] == [True]
        with pytest.raises(RuntimeError, match="test-worker worker is shut down"):
            worker.submit(done.append, 3)
    finally:
        never.set()
    assert stuck.result(60) == (None, True)
