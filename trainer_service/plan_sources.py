"""Where a trainer process's plans come from: process 0 makes them (LeaderSource; with trainer.processes > 1 it
sends each to the others before applying it), the others receive them (FollowerSource).

Every process runs `drive(source, core)`: for each plan, the core applies it and the source sees the result
(`applied`). Process 0's source is also the core's hooks: the device-free effects of a step (audit trail, held
count, status, metrics) happen here, never in the core.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time
from typing import Callable, Iterator

import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.heartbeat import Heartbeat, beat
from grpo_stream.trainer_service.learning.batching import TrainBatch, build_batch
from grpo_stream.trainer_service.control_messages import ControlMessageError
from grpo_stream.trainer_service.core import CoreHooks, StepResult, TrainerCore
from grpo_stream.trainer_service.learning.off_policy_health import HealthMonitor, group_index_of, version_diagnostics
from grpo_stream.trainer_service.learning.packing import PackedBatch
from grpo_stream.trainer_service.plan_prefetch import PlanPrefetch
from grpo_stream.trainer_service.plans import (DonePlan, FinishPlan, Plan, StartPlan, StepPlan, done_plan, finish_plan,
                                              from_message, start_plan, step_plan, to_message)
from grpo_stream.trainer_service.publication.samplers import SamplerRegistry

log = logging.getLogger(__name__)


def drive(source, core: TrainerCore, run_dir: pathlib.Path, name: str) -> None:
    """Apply every plan of `source` with `core`; a heartbeat after each, and during the long ones (a warm start's
    steps, an evaluation's batches): `up` restarts a job that stops beating (up.trainer_stall_s)."""
    heartbeat = Heartbeat(run_dir, name)
    core.progress = heartbeat
    heartbeat.now()
    for plan in source:
        result = core.apply(plan)
        source.applied(plan, result)
        heartbeat()  # at most every few seconds: a file written every step would be the steps' overhead


@dataclasses.dataclass
class _StepContext:
    """What process 0 knows of a step beyond its plan: the groups, and when its phases began."""
    picked: list
    staleness: np.ndarray
    stats: dict
    t0: float
    phases: dict


@dataclasses.dataclass
class _Prepared:
    """A step's plan as `_prepare` made it (on the prefetch thread or the main one), before the main thread takes
    it: only then is it recorded (`_take`), sent and applied."""
    plan: StepPlan
    picked: list
    staleness: np.ndarray
    stats: dict
    phases: dict  # collect, batch and pack seconds, wherever they ran


class LeaderSource(CoreHooks):
    """Process 0 (or the only process): plans from the config, the checkpoints and the rollout buffer."""

    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, services, group=None):
        """`services`: process 0's device-free parts (loop.LeaderServices: buffer, durability, collector, publisher,
        reporter, status, stop event); `group`: the other processes to send every plan to (multihost.py)."""
        self.cfg, self.run_dir, self.s, self.group = cfg, run_dir, services, group
        self.steps_done = self.saved = self.start_step = 0
        self.eval_after: dict | None = None
        self.rl_seconds = 0.0
        # trained groups whose completions mix weight versions (in-flight updates), in the whole run: carried in the
        # checkpoints (`carried`, `restored`)
        self.mixed_version_groups = 0
        self.agreement = {"tokens": 0.0, "abs_sum": 0.0, "max_abs": 0.0}
        self.step_times: list[dict[str, float]] = []  # per RL step: phase seconds and step_seconds (bench/)
        # of the batches trained: what the update computed over (packed or padded rows) and what the padded layout
        # would have laid out: the padding fractions in summary.json
        self.tokens = {"real": 0, "laid_out": 0, "padded_laid_out": 0}
        self._context: dict[int, _StepContext] = {}
        self.health = HealthMonitor()  # warns when the run's off-policy diagnostics leave trainer.health's band
        # the core's host packing (TrainerCore.pack), set once the core exists (loop.py): plans come packed, so the
        # update starts at once and the step's phases (reports/step_report.py) hold its packing where it ran
        self.pack: Callable[[TrainBatch], PackedBatch] | None = None
        self.prefetch: PlanPrefetch | None = None  # during the RL steps

    def _send(self, plan: Plan) -> Plan:
        if self.group is not None:
            kind, fields, arrays = to_message(plan)
            self.group.send(kind, fields, None if arrays is None else {k: np.asarray(v) for k, v in arrays.items()})
        return plan

    def __iter__(self) -> Iterator[Plan]:
        s, cfg = self.s, self.cfg
        # process 0 chooses the checkpoint every process restores (checkpoints/store.py: choose_step)
        restore = s.checkpoints.choose_step() if self.group is not None else (s.checkpoints.steps() or [None])[-1]
        yield self._send(start_plan(cfg, s.epoch, restore))
        rl_start = time.time()
        yield from self._steps()  # ends only once no prefetch runs
        self.rl_seconds = time.time() - rl_start
        complete = self.steps_done == cfg.trainer.steps
        yield self._send(finish_plan(cfg, self.steps_done, complete, checkpoint=self.steps_done > self.saved,
                                     publish=complete and self.steps_done == self.start_step))
        if complete:
            self.await_samplers(self.steps_done)
            yield self._send(done_plan(cfg))

    def _steps(self) -> Iterator[StepPlan]:
        """The RL steps' plans, each sent to the other processes and yielded by the main thread, in order; with
        trainer.prefetch_plans the next one is prepared while the core applies this one (plan_prefetch.py)."""
        s, cfg = self.s, self.cfg
        if self.pack is None:
            raise RuntimeError("LeaderSource.pack is not set: give it the core's (TrainerCore.pack) before the steps")
        self.prefetch = prefetch = PlanPrefetch(self._prepare, cfg.trainer.prefetch_plans)
        failed, last_end = True, time.time()
        try:
            for step in range(self.steps_done + 1, cfg.trainer.steps + 1):
                if s.stop_event.is_set():  # SIGTERM: stop between steps even when groups are at hand
                    break
                prepared, ahead = prefetch.take(step)
                if prepared is None:  # stopped while waiting for groups
                    break
                plan = self._take(prepared, ahead, last_end)
                self._send(plan)
                if step < cfg.trainer.steps:
                    prefetch.submit(step + 1)
                yield plan
                last_end = time.time()
            failed = False
        finally:
            prefetch.close(failed)

    def _prepare(self, step: int, cancel: threading.Event) -> _Prepared | None:
        """The step's plan from the groups the collector picks for it (None: stopped or cancelled while waiting for
        them). Device-free and free of the source's bookkeeping: it runs on the prefetch thread."""
        s, cfg = self.s, self.cfg
        t0 = time.time()
        picked = s.collector.collect(step, cancel)
        if picked is None:
            return None
        t_collect = time.time()
        groups = [g for _, g in picked]
        batch, stats = build_batch(groups, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens,
                                   s.pad_id, cfg.algo, held_version=step - 1)
        t_batch = time.time()
        packed = self.pack(batch)
        phases = {"collect_seconds": t_collect - t0, "batch_seconds": t_batch - t_collect,
                  "pack_seconds": time.time() - t_batch}
        staleness = np.array([step - 1 - g.policy_version for g in groups])
        return _Prepared(step_plan(cfg, step, batch, group_index_of(groups), packed), picked, staleness, stats,
                         phases)

    def _take(self, prepared: _Prepared, ahead: bool, t0: float) -> StepPlan:
        """Record the plan the main thread is about to apply: its context for the hooks, the tokens laid out, the
        batch file (record_batches). `ahead`: made on the prefetch thread, so its collect, batch and pack seconds
        overlapped the previous update; `plan_wait_seconds` is what the main thread spent getting it."""
        plan, cfg = prepared.plan, self.cfg
        self.tokens["padded_laid_out"] += int(np.asarray(plan.batch.valid).size)
        if cfg.trainer.record_batches:
            (self.run_dir / "batches").mkdir(exist_ok=True)
            np.savez(self.run_dir / "batches" / f"step-{plan.step:06d}.npz",
                     **{f.name: np.asarray(getattr(plan.batch, f.name)) for f in dataclasses.fields(plan.batch)})
        for old in [s for s in self._context if s < plan.step - 2]:  # reported: the worker is at most one step behind
            del self._context[old]
        self._context[plan.step] = _StepContext(prepared.picked, prepared.staleness, prepared.stats, t0, {
            **prepared.phases, "prepared_ahead": float(ahead), "plan_wait_seconds": time.time() - t0})
        return plan

    def close(self) -> None:
        """After a failure: cancel a prefetch still running (the steps' generator does it when it is closed too)."""
        if self.prefetch is not None:
            self.prefetch.close(failed=True)

    def collector_waiting(self) -> None:
        """The collector waits for groups (every 10 s): a heartbeat, but only while the main thread waits for that
        plan too; a prefetch beating while the main thread hangs in an update would hide the hang from `up`."""
        if self.prefetch is None or self.prefetch.main_waits:
            beat(self.run_dir, "trainer-0")

    # -- results and hooks ----------------------------------------------------------------------------------------
    def applied(self, plan: Plan, result) -> None:
        if isinstance(plan, StartPlan):
            self.steps_done = self.saved = self.start_step = result
            self.s.status.step = result
        elif isinstance(plan, StepPlan):
            self.steps_done = self.s.status.step = plan.step
            self.saved = plan.step if plan.checkpoint else self.saved
            context = self._context[plan.step]
            # step_seconds: the main thread's, from the previous step's end (what it waited for the plan included)
            self.step_times.append({**context.phases, **result.phases, "step_seconds": time.time() - context.t0})
        elif isinstance(plan, FinishPlan):
            self.eval_after = result

    def trained(self, plan: StepPlan, metrics: dict) -> None:
        picked = self._context[plan.step].picked
        self.s.durability.trained(plan.step, picked)
        # counted here, not in the report (which may come after the checkpoint of this step is saved)
        self.mixed_version_groups += int(version_diagnostics([g for _, g in picked], plan.step - 1,
                                                             self.cfg.trainer.max_staleness)["mixed_version_groups"])
        self.tokens["real"] += int(metrics["update_tokens_real"])
        self.tokens["laid_out"] += int(metrics["update_tokens_laid_out"])
        if metrics["fresh_tokens"]:  # run-long sampler-trainer logprob agreement at version lag 0
            a = self.agreement
            a["tokens"] += metrics["fresh_tokens"]
            a["abs_sum"] += metrics["logprob_diff_mean"] * metrics["fresh_tokens"]
            a["max_abs"] = max(a["max_abs"], metrics["logprob_diff_max"])

    def report(self, plan: StepPlan, metrics: dict, phases: dict) -> None:
        context = self._context[plan.step]
        groups = [g for _, g in context.picked]
        metrics = {**metrics, **version_diagnostics(groups, plan.step - 1, self.cfg.trainer.max_staleness)}
        warning = self.health.observe(plan.step, metrics, self.cfg)
        if warning:
            log.warning("%s", warning)
        metrics.update(self.health.metrics())
        tokens_per_s, groups_per_s = self.s.reporter.rates(int(np.asarray(plan.batch.loss_mask).sum()), len(groups))
        self.s.reporter.report(plan.step, groups, context.staleness, context.stats, metrics,
                               {**context.phases, **phases}, tokens_per_s, groups_per_s)

    def carried(self) -> dict:
        return {"groups_trained_mixed_versions": self.mixed_version_groups}

    def restored(self, record: dict) -> None:
        self.mixed_version_groups = int(record.get("groups_trained_mixed_versions") or 0)

    def evaluated(self, step: int, values: dict[str, float]) -> None:
        """eval/* at the RL step whose weights were evaluated (eval/version says which version: the same number)."""
        self.s.metrics.scalars(step, values, prefix="eval/")

    def await_samplers(self, final_version: int) -> None:
        await_samplers(self.cfg, self.s.publisher.samplers, self.s.stop_event, final_version,
                       progress=Heartbeat(self.run_dir, "trainer-0"))


def await_samplers(cfg: RunConfig, samplers: SamplerRegistry, stop: threading.Event, final_version: int,
                   progress=None) -> None:
    """Until every sampler installed the final version (so each stops by itself), or trainer.final_wait_s. Every one
    means at least sampler.replicas: a restarted trainer knows only the samplers that reported to it since, and one
    backing off after the restart (up to 10 s) would otherwise be left behind, never told."""
    deadline = time.time() + cfg.trainer.final_wait_s
    while time.time() < deadline and not stop.is_set():
        at = samplers.samplers_at(final_version)
        if progress is not None:
            progress()
        if at and all(at.values()) and len(at) >= cfg.sampler.replicas:
            log.info("every sampler (%d) installed the final version %d", len(at), final_version)
            return
        time.sleep(0.2)
    if stop.is_set():  # a stop during the last step or this wait: it was cut short, not waited out
        log.info("not waiting for the samplers to install the final version %d: the trainer is stopping (%s)",
                 final_version, samplers.samplers_at(final_version))
        return
    log.warning("samplers not at final version %d after %.0fs: %s", final_version, cfg.trainer.final_wait_s,
                samplers.samplers_at(final_version))


class FollowerSource:
    """Trainer processes 1..N-1: process 0's plans, checked for their order (a step after the one before; the end
    at the step this process is at). With trainer.prefetch_plans the next message is received and its batch packed
    on the prefetch thread while the core applies this one, as process 0 prepares its plans."""

    def __init__(self, cfg: RunConfig, group):
        self.cfg, self.group = cfg, group
        self.steps_done: int | None = None
        self.pack: Callable[[TrainBatch], PackedBatch] | None = None  # as LeaderSource.pack

    def _next(self, *kinds: str) -> Plan:
        message, arrays = self.group.receive(*kinds)
        return from_message(self.cfg, message, arrays)

    def _receive(self, step: int, cancel: threading.Event) -> Plan:
        """Process 0's next step (packed) or finish plan. Not cancellable: the wait is the coordination service's,
        and a follower that fails exits at once (follower.py: stop_now)."""
        plan = self._next("step", "finish")
        if isinstance(plan, StepPlan) and self.pack is not None:
            plan = dataclasses.replace(plan, packed=self.pack(plan.batch))
        return plan

    def __iter__(self) -> Iterator[Plan]:
        yield self._next("start")
        prefetch, failed = PlanPrefetch(self._receive, self.cfg.trainer.prefetch_plans), True
        try:
            while True:
                plan, _ = prefetch.take(self.steps_done + 1)
                if isinstance(plan, FinishPlan):
                    break
                if plan.step != self.steps_done + 1:
                    raise ControlMessageError(f"trainer process {self.group.index}: process 0 sent step {plan.step} "
                                              f"after step {self.steps_done}")
                prefetch.submit(plan.step + 1)  # the step after it, or the finish
                yield plan
            failed = False
        finally:
            prefetch.close(failed)
        if plan.steps != self.steps_done:
            raise ControlMessageError(f"trainer process {self.group.index}: process 0 finished at step "
                                      f"{plan.steps}, this process is at step {self.steps_done}")
        yield plan
        if plan.complete:
            yield self._next("done")

    def applied(self, plan: Plan, result) -> None:
        if isinstance(plan, StartPlan):
            self.steps_done = result
        elif isinstance(plan, StepPlan):
            self.steps_done = plan.step


__all__ = ["DonePlan", "FollowerSource", "LeaderSource", "StepResult", "await_samplers", "drive"]
