"""Held-out evaluation during RL (eval.every_steps): published versions evaluated on one background thread of
trainer process 0 while the steps go on.

Scheduling, when evaluation is slower than training: one evaluation runs at a time and at most one waits. A version
that comes due while another waits replaces it: the waiting one is skipped (counted in `skipped`, logged), the running
one is never interrupted. So the curve always reaches the newest version the evaluation can keep up with, memory holds
at most two extra copies of the weights (the running and the waiting version's), and a slow evaluation never makes a
step wait. `max_share` bounds the wall time the evaluation computes (`DutyCycle`), so the devices it shares with the
steps are taken from them for at most that share; the end of the run lifts it (`drain`).

An evaluation that raises (SystemExit included) is logged and counted (`errors`), never raised: the run goes on
without that point.

A stop (`close`) cancels the evaluation still running: its next progress call raises `EvaluationCancelled` (it ends
as its groups end, its engine released), and its version is recorded as skipped. The process's exit waits for that
(at most CLOSE_WAIT_S): a thread still computing on the devices when the interpreter shuts down aborted the process
(SIGABRT or SIGSEGV from XLA), so a trainer stopped during an evaluation exited as crashed after a clean stop.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)
SUMMARY_KEYS = ("accuracy", "format_rate", "reward", "num_problems", "seconds", "pass_at_k", "maj_at_k", "task_metrics",
                "reward_components", "failed_episodes", "sampled_reward")
# how long the process's exit waits for a cancelled evaluation to reach its next progress call and end
CLOSE_WAIT_S = 60.0


class EvaluationCancelled(Exception):
    """Raised by a cancelled DutyCycle's call: the evaluation calling it ends (the run is stopping)."""


def curve_row(step: int, when: str, result: dict) -> dict:
    """The compact row of one evaluation that summary.json's `eval_curve` and the checkpoints keep (no examples)."""
    return {"step": step, "version": step, "when": when, **{k: result.get(k) for k in SUMMARY_KEYS}}


def metric_values(result: dict) -> dict[str, float]:
    """The scalars of one evaluation (under `eval/` in metrics, TensorBoard and W&B): greedy accuracy, format rate,
    reward and its components (greedy, and sampled when eval.samples > 0), pass@k, maj@k, the task's own figures,
    seconds."""
    values = {"accuracy": result["accuracy"], "format_rate": result["format_rate"], "reward": result["reward"],
              "num_problems": result["num_problems"], "seconds": result["seconds"],
              "failed_episodes": result.get("failed_episodes", 0)}
    values.update({f"pass_at_{k}": v for k, v in (result.get("pass_at_k") or {}).items()})
    values.update({f"maj_at_{k}": v for k, v in (result.get("maj_at_k") or {}).items()})
    values.update({f"task/{k}": v for k, v in (result.get("task_metrics") or {}).items()})
    values.update({f"reward/{k}": v for k, v in (result.get("reward_components") or {}).items()})
    values.update({f"sampled_reward/{k}": v for k, v in (result.get("sampled_reward_components") or {}).items()})
    if result.get("sampled_reward") is not None:
        values["sampled_reward"] = result["sampled_reward"]
    return {k: float(v) for k, v in values.items() if v is not None}


class DutyCycle:
    """A progress callback that keeps the caller's computing to `share` of wall time: each call sleeps for the time
    computed since the previous call times (1 - share) / share. `release()` stops the pauses (and ends one);
    `cancel()` also makes every later call raise EvaluationCancelled."""

    def __init__(self, share: float, released: threading.Event | None = None, clock=time.monotonic):
        self.share, self.clock = share, clock
        self.released = released or threading.Event()
        self.cancelled = threading.Event()
        self.paused_s = 0.0
        self._since = clock()

    def restart(self) -> None:
        self._since = self.clock()

    def __call__(self) -> None:
        self._check()
        if self.share < 1.0 and not self.released.is_set():
            started = self.clock()
            self.released.wait((started - self._since) * (1.0 - self.share) / self.share)
            self.paused_s += self.clock() - started  # what it waited: a release ends a pause early
            self._check()
        self._since = self.clock()

    def _check(self) -> None:
        if self.cancelled.is_set():
            raise EvaluationCancelled("the in-run evaluator was closed: the run is stopping")

    def release(self) -> None:
        self.released.set()

    def cancel(self) -> None:
        self.cancelled.set()
        self.released.set()


@dataclasses.dataclass
class _Due:
    step: int
    params: Any


class InRunEvaluator:
    """Evaluates the versions `submit`ted on its own thread ("eval"); see the module docstring for the schedule.

    `evaluate(step, params, progress) -> dict`: the evaluation (EvalResult.as_dict), calling `progress` as groups end;
    `record(step, result)`: what is done with each result (metrics); `share`: eval.max_share."""

    def __init__(self, evaluate: Callable[[int, Any, Callable[[], None]], dict], record: Callable[[int, dict], None],
                 share: float = 1.0, curve: list[dict] | None = None):
        self._evaluate, self._record = evaluate, record
        self.throttle = DutyCycle(share)
        self.curve: list[dict] = list(curve or [])  # finished evaluations' rows, in the order they finished
        self.skipped: list[int] = []
        self.cancelled: list[int] = []  # versions whose evaluation a close ended (in state()'s eval_skipped)
        self.errors = 0
        self._cond = threading.Condition()
        self._waiting: _Due | None = None
        self._running: int | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._exit_waits = False  # the process's exit waits for the thread (close)

    def evaluated(self, step: int) -> bool:
        with self._cond:
            return any(r["step"] == step and r["when"] == "during" for r in self.curve)

    def submit(self, step: int, params: Any) -> None:
        """Evaluate the weights of `step` when the thread is free; replaces (skips) a version still waiting."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the in-run evaluator is closed")
            if step in self.skipped:  # a resumed trainer's restored version, pending when its checkpoint was saved
                self.skipped.remove(step)
            if self._waiting is not None:
                self.skipped.append(self._waiting.step)
                log.info("evaluation of version %d skipped: version %d came due while it waited (evaluation is "
                         "slower than eval.every_steps of training)", self._waiting.step, step)
            self._waiting = _Due(step, params)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="eval", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> list[int]:
        """Versions running or waiting, in that order."""
        with self._cond:
            return [s for s in (self._running, self._waiting and self._waiting.step) if s is not None]

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                due, self._waiting = self._waiting, None
                self._running = due.step
            self._run(due)
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _run(self, due: _Due) -> None:
        try:
            self.throttle.restart()
            result = self._evaluate(due.step, due.params, self.throttle)
            with self._cond:
                self.curve.append(curve_row(due.step, "during", result))
            self._record(due.step, result)
        # an evaluation never fails the run: logged, counted, and the run goes on. BaseException too: this thread
        # gets no KeyboardInterrupt (signals go to the main thread), and a SystemExit from code the evaluation runs
        # (a reward function, an environment) would otherwise end the thread with this version still running, so
        # drain() never returned and no later version was evaluated
        except BaseException as exc:  # noqa: BLE001
            if self.throttle.cancelled.is_set():  # closed: the run stops, this is no evaluation error
                with self._cond:
                    self.cancelled.append(due.step)
                log.info("evaluation of version %d cancelled: the run is stopping (%s)", due.step,
                         type(exc).__name__)
                return
            with self._cond:
                self.errors += 1
            log.exception("evaluation of version %d failed (%d evaluation errors in this run); training goes on",
                          due.step, self.errors)
        finally:
            due.params = None  # the copy of the weights goes as soon as it is evaluated

    def drain(self, timeout_s: float | None = None) -> bool:
        """Until nothing runs or waits (the pauses lifted: training is over); False when `timeout_s` passed first."""
        self.throttle.release()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._running is not None or self._waiting is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Stop the thread: a waiting evaluation is dropped (counted as skipped), the running one is cancelled (it
        ends at its next progress call, recorded as skipped too). Returns at once; the process's exit waits for the
        thread to end (at most CLOSE_WAIT_S), and `join` waits for it here."""
        self.throttle.cancel()
        with self._cond:
            if self._waiting is not None:
                self.skipped.append(self._waiting.step)
                self._waiting = None
            self._closed = True
            self._cond.notify_all()
            thread, waits, self._exit_waits = self._thread, self._exit_waits, True
        if thread is not None and not waits:
            atexit.register(_join_at_exit, thread)

    def join(self, timeout_s: float | None = None) -> bool:
        """After `close`: until the thread ended (False when `timeout_s` passed first)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def state(self) -> dict:
        """What summary.json and the checkpoints keep: the curve so far, the skipped versions and the errors. A version
        running or waiting now is recorded as skipped: a trainer resumed from this record (or a stopped one, whose
        summary this is) never evaluates it, so without that it would be in neither list. One that ends in this
        process is in the next record's curve instead; a resumed trainer that evaluates one again (`submit`) takes it
        off the list."""
        with self._cond:
            done = {r["step"] for r in self.curve if r["when"] == "during"}  # the running one's row may be in
            pending = [s for s in (self._running, self._waiting and self._waiting.step)
                       if s is not None and s not in self.skipped and s not in done]
            cancelled = [s for s in self.cancelled if s not in self.skipped and s not in done]
            return {"eval_curve": list(self.curve), "eval_skipped": self.skipped + cancelled + pending,
                    "eval_errors": self.errors}


def _join_at_exit(thread: threading.Thread) -> None:
    """atexit: wait for a closed evaluator's thread (its cancelled evaluation ends at its next progress call) before
    the interpreter shuts down: XLA work on a thread then aborts the process."""
    thread.join(CLOSE_WAIT_S)
    if thread.is_alive():
        log.warning("the in-run evaluation did not end within %.0fs of the stop; exiting anyway", CLOSE_WAIT_S)
