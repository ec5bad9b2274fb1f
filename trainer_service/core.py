"""TrainerCore: the only trainer code that touches devices, the same in every trainer process.

It applies plans (plans.py) and nothing else decides what it does: process 0 and the others of a multi-process
trainer run this one class on the same plans, so they launch the same programs and collectives in the same order by
construction, not by keeping two copies of the code alike. What differs between processes stays outside, device-free:
where plans come from (plan_sources.py), the checkpoint bookkeeping (`keeper`: process 0's Durability acknowledges
groups; the others save their shards) and process 0's hooks (audit, status, reports, summary)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import pathlib
import threading
import time
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.episodes.evaluation import greedy_probe
from grpo_stream.common.model.hf_checkpoint import export_hf, resolve_model_dir
from grpo_stream.common.weights.snapshot import digest
from grpo_stream.trainer_service.checkpoints.durability import Resumed
from grpo_stream.trainer_service.learning.params_policy import params_policy
from grpo_stream.trainer_service.daemon_worker import DaemonWorker
from grpo_stream.trainer_service.plans import (DonePlan, FinishPlan, Plan, StartPlan, StepPlan, check_within_steps,
                                               evaluated_during_rl)
from grpo_stream.trainer_service.learning.packing import packing_layout
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater, state_report
from grpo_stream.trainer_service.reports.in_run_eval import EvaluationCancelled, InRunEvaluator, metric_values
from grpo_stream.trainer_service.reports.run_outputs import evaluate_heldout
from grpo_stream.trainer_service.learning.warmstart import warm_start
from grpo_stream.trainer_service.model_parts import ModelParts

log = logging.getLogger(__name__)
# what a resumed run carries over from its checkpoint's record (carried_now); the evaluator's own state wins
CARRIED_KEYS = ("warmstart", "eval_before", "eval_curve", "eval_skipped", "eval_errors")
BACKGROUND_WAIT_S = 1800.0  # the longest a step waits for the previous one's publication (a stuck transfer)


def waited(future: concurrent.futures.Future, what: str) -> Any:
    """future.result() within BACKGROUND_WAIT_S; past it a TimeoutError naming `what` (a bare one says nothing)."""
    if not concurrent.futures.wait([future], timeout=BACKGROUND_WAIT_S).done:
        raise TimeoutError(f"{what} did not end in {BACKGROUND_WAIT_S:.0f}s; check where it writes (weights.transport"
                           "'s storage or peers, Redis, checkpoint.dir) and the trainer's last log lines")
    return future.result()


class CheckpointKeeper(Protocol):
    """Checkpoints as one trainer process keeps them: process 0's Durability (records, acknowledgements, audit) or
    a follower's shards (follower.py: ShardKeeper)."""

    def restore(self, step: int, updater: PolicyUpdater) -> Resumed | None: ...
    def begin_new_run(self) -> None: ...
    def save(self, step: int, updater: PolicyUpdater, carried: dict) -> None: ...
    def committed(self, wait: bool = False, everything: bool = False) -> None: ...


class CoreHooks:
    """Device-free effects around the core's work; process 0 overrides them (plan_sources.LeaderSource)."""

    def trained(self, plan: StepPlan, metrics: dict) -> None:
        """After the update of `plan`, before its checkpoint (which records what this says)."""

    def report(self, plan: StepPlan, metrics: dict, phases: dict) -> None:
        """On the background worker, after the step's publication."""

    def evaluated(self, step: int, values: dict[str, float]) -> None:
        """A held-out evaluation of the weights after `step` (0: before RL), its scalars (in_run_eval.metric_values);
        on the step-report thread, so the trackers take one record at a time."""

    def carried(self) -> dict:
        """Run-long counts of these hooks that each checkpoint's record keeps, as of the steps `trained` saw (all of
        those the checkpoint holds: it is saved after them), so a resumed trainer goes on counting (`restored`)."""
        return {}

    def restored(self, record: dict) -> None:
        """The record of the checkpoint a resumed trainer restored (what `carried` put there)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    metrics: dict  # the update's (host values)
    # seconds: the previous publication waited for, packing (when the plan came unpacked), computing, handing off
    phases: dict


class TrainerCore:
    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, parts: ModelParts, publisher, keeper: CheckpointKeeper,
                 *, donate: bool, metrics=None, hooks: CoreHooks | None = None, writes_files: bool = True,
                 warm_stop: threading.Event | None = None):
        """`writes_files`: this process writes exports (process 0; the others take part in their gathers);
        `warm_stop`: ends the warm start and eval_before/eval_after early (a one-process trainer's stop event;
        several processes run them in lockstep, so a signal takes effect after them)."""
        self.cfg, self.run_dir, self.parts, self.publisher, self.keeper = cfg, run_dir, parts, publisher, keeper
        self.donate, self.metrics, self.hooks = donate, metrics, hooks or CoreHooks()
        self.writes_files, self.warm_stop = writes_files, warm_stop
        self.model, self.params = parts.model, parts.model.params
        self.policy = params_policy(cfg)
        self.updater: PolicyUpdater | None = None
        self.carried: dict = {}  # what checkpoints carry along: the warm start's report, eval_before
        self.start_step = 0
        self.resumed_from: dict | None = None
        self.final_weights: dict | None = None
        self.progress: Callable[[], None] | None = None  # a heartbeat for long phases (plan_sources.drive sets it)
        # publications on one thread, process 0's step reports on another (daemons: one stuck must not keep a failed
        # process from exiting): a donating update waits for the previous publication, never for a report
        self._worker, self._reporter = DaemonWorker("publish"), DaemonWorker("step-report")
        self._pending: list[concurrent.futures.Future] = []  # publications and reports, in the order submitted
        self._publishing: concurrent.futures.Future | None = None
        # the publication a donating update must wait for (it reads the parameters that update overwrites); None
        # when it reads a copy (weights.publish_copy)
        self._reading: concurrent.futures.Future | None = None
        self._copies = donate and cfg.weights.publish_copy
        # each step's bookkeeping (process 0: its groups recorded in Redis; every process: the checkpoint poll) on a
        # thread of its own, beside the next update; at most one step behind, and done before a checkpoint is saved
        self._books = DaemonWorker("step-books")
        self._settling: concurrent.futures.Future | None = None
        self.evaluator: InRunEvaluator | None = None  # eval.every_steps: evaluation during RL, on its own thread

    def apply(self, plan: Plan) -> Any:
        apply = {StartPlan: self.start, StepPlan: self.step, FinishPlan: self.finish, DonePlan: self.done}
        if type(plan) in apply:
            return apply[type(plan)](plan)
        raise TypeError(f"TrainerCore applies StartPlan, StepPlan, FinishPlan or DonePlan, not {type(plan).__name__}")

    # -- start --------------------------------------------------------------------------------------------------
    def start(self, plan: StartPlan) -> int:
        """Restore `plan.restore`, or warm start and evaluate a new run; publish the weights. Returns the step the
        weights are at."""
        self.publisher.epoch = plan.epoch  # the versions are process 0's
        resumed = None
        if plan.restore is not None:
            self.updater = self._new_updater()
            resumed = self.keeper.restore(plan.restore, self.updater)
        if resumed is not None:
            check_within_steps(self.cfg, resumed.step)
            self.hooks.restored(resumed.record)
            state = resumed.state
            self.updater.params, self.updater.opt_state = state["params"], state["opt_state"]
            self.updater.ref_params = state.get("ref_params", self.updater.ref_params)
            self.params, self.start_step = self.updater.params, resumed.step
            self.resumed_from = {"step": resumed.step, "epoch": resumed.record.get("epoch")}
            # the evaluation curve too: a run resumed with eval.every_steps=0 keeps the points it has
            self.carried = {key: resumed.record.get(key) for key in CARRIED_KEYS}
        else:
            self.keeper.begin_new_run()
            self._new_run(plan)
        self._start_evaluator(resumed.record if resumed is not None else {})
        self._publish(self.start_step, self.params)
        log.info("published weight version %d; RL %s", self.start_step,
                 f"resumes at step {self.start_step + 1}" if resumed else "starts")
        return self.start_step

    def _new_run(self, plan: StartPlan) -> None:
        warm = None
        if plan.warm_start:
            p = self.parts
            self.params, warm = warm_start(self.model, self.params, p.task, p.tokenizer, self.cfg, self.metrics,
                                           self.warm_stop, progress=self.progress)
        # stopped (in the warm start or before): no step or checkpoint follows, the next start does this again
        if plan.warm_start and plan.export_warm and not (self.warm_stop is not None and self.warm_stop.is_set()):
            self._export("warmstart-model", "warm-started")
        self.carried = {"warmstart": warm, "eval_before": self.evaluate("eval_before", 0) if plan.eval_before else None}
        self.updater = self._new_updater()
        self.params = self.updater.params

    def _new_updater(self) -> PolicyUpdater:
        """The updater of the plain params at hand (initial, warm-started): with model.lora, of the adapted model
        built around them (learning/params_policy.py)."""
        cfg, t = self.cfg, self.cfg.trainer
        model, params, trainable = self.policy.trained(self.model.with_remat(t.remat), self.params)
        mesh = self.parts.mesh
        layout = packing_layout(cfg, mesh.shape["fsdp"] if mesh is not None else 1, self.model.arch)
        return PolicyUpdater(model, params, cfg.algo, t.learning_rate, t.max_grad_norm, cfg.generation.temperature,
                             self.parts.tokenizer.pad_id, layout, mesh, t.optimizer, t.steps, donate=self.donate,
                             trainable=trainable, teacher=self.parts.teacher,
                             distill=cfg.distill if self.parts.teacher is not None else None)

    # -- steps --------------------------------------------------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        """One update; its bookkeeping, publication and process 0's report on background threads, which run while the
        next step computes (XLA releases the GIL): at most one step behind. A checkpoint is saved here."""
        t0 = time.time()
        if self.donate and self._reading is not None:  # it reads the parameters this update overwrites
            waited(self._reading, f"the weight publication of step {plan.step - 1}")
        t_published = time.time()
        # on the host, in numpy (placed on the mesh once, by the update); a prefetched plan comes packed
        packed = plan.packed if plan.packed is not None else self.pack(plan.batch)
        t_packed = time.time()
        # with weights.publish_copy the update also leaves a device copy of the new parameters for the publication
        # to read (dispatched while the update computes), so the next update need not wait for it
        copies = plan.publish and self._copies
        metrics = self.updater.update(packed, plan.group_index, copy_params=copies)
        self.params = self.updater.params
        published = self.updater.take_params_copy() if copies else self.params
        t_compute = time.time()
        self._settled()  # the previous step's books (re-raises what failed there)
        if plan.checkpoint:  # the checkpoint's record lists this step's groups: they are recorded first, here
            self.hooks.trained(plan, metrics)
            if plan.final:  # the last record keeps the evaluations still running: a complete run resumed reads it
                self._drain_evaluations()
            self.keeper.save(plan.step, self.updater, self.carried_now())
            self._settling = self._books.submit(self.keeper.committed)
        else:
            self._settling = self._books.submit(self._settle, plan, metrics)
        self._wait_publications()
        phases = {"publish_wait_seconds": t_published - t0, "compute_seconds": t_compute - t_packed,
                  "handoff_seconds": time.time() - t_compute}
        if plan.packed is None:  # packed here, on this thread (else where the plan was made: its source times it)
            phases["pack_seconds"] = t_packed - t_published
        self._publishing = self._worker.submit(self._publish_due, plan, published)
        self._reading = self._publishing if published is self.params else None
        self._pending += [self._publishing, self._reporter.submit(self._report, self._publishing, plan, metrics, phases)]
        if plan.evaluate and self.evaluator is not None:
            self._submit_evaluation(plan.step)
        return StepResult(metrics, phases)

    def _settle(self, plan: StepPlan, metrics: dict) -> None:
        """A step's books, on their thread: its groups recorded (process 0), then the checkpoints that finished."""
        self.hooks.trained(plan, metrics)
        self.keeper.committed()

    def _settled(self) -> None:
        """Until the previous step's books are done; re-raises what failed there."""
        if self._settling is not None:
            settling, self._settling = self._settling, None
            waited(settling, "the previous step's books (its groups recorded in Redis, checkpoints committed)")

    def pack(self, batch):
        """`batch` packed for this core's update (numpy only, so any thread may call it once the start plan made the
        updater): what a plan source that prepares plans ahead packs them with."""
        return self.updater.pack(batch)

    def _publish_due(self, plan: StepPlan, params) -> None:
        if plan.publish:
            self._publish(plan.step, params, final=plan.final)

    def _report(self, published: concurrent.futures.Future, plan: StepPlan, metrics: dict, phases: dict) -> None:
        """The step's report, after its publication (the report names the version published); a failed publication
        is re-raised by the waits on it, and its step is not reported."""
        if published.exception(timeout=BACKGROUND_WAIT_S) is None:
            self.hooks.report(plan, metrics, phases)

    def _wait_publications(self) -> None:
        """Until the background publications and reports are done; re-raises what failed there."""
        while self._pending:
            waited(self._pending.pop(0), "a weight publication or step report")

    def wait_background(self) -> None:
        """Until the background books, publications and reports are done; re-raises what failed there."""
        self._settled()
        self._wait_publications()

    # -- the end ------------------------------------------------------------------------------------------------
    def finish(self, plan: FinishPlan) -> dict | None:
        """The last checkpoint and, for a complete run, the export, the final publication and eval_after. Returns the
        final evaluation (None when there is none)."""
        self.wait_background()
        if plan.checkpoint:  # stopped by a signal between checkpoints: keep what was trained
            self.keeper.save(plan.steps, self.updater, self.carried_now())
        self.keeper.committed(wait=True, everything=plan.complete)
        if not plan.complete:
            if self.evaluator is not None:  # a stop is not held up by evaluations: a resume redoes a due one
                self.evaluator.close()
            log.info("stopped at step %d %s", plan.steps, "with a checkpoint; start the trainer again to resume" if
                     plan.steps else "before the first RL step, with nothing to keep: a new start begins the run again")
            return None
        self._drain_evaluations()
        # the model and the final version first: a failing eval_after (it fails every restart) must not cost them
        self._export("model", "trained")  # serve it, or `eval` it
        if plan.publish:  # a resumed, already complete run: tell samplers to stop
            self._publish(plan.steps, self.params, final=True)
        return self.evaluate("eval_after", plan.steps) if plan.eval_after else None

    def done(self, plan: DonePlan) -> dict | None:
        """The final weights' digest and greedy outputs on weights.verify_prompts problems (samplers compare
        theirs); a gather and a generation every process takes part in."""
        if not plan.verify:
            return None
        plain, p = self.policy.plain(self.params), self.parts
        try:
            greedy = greedy_probe(p.engine, plain, p.tokenizer, p.task.heldout(plan.verify), self.cfg.eval.batch_size,
                                  progress=self.progress)
        finally:
            p.engine.release()
        self.final_weights = {"version": self.publisher.latest_version,
                              "sha256": digest(self.model.to_named_numpy(plain)), "greedy": greedy}
        return self.final_weights

    # -- evaluation during RL (eval.every_steps) -------------------------------------------------------------------
    def _start_evaluator(self, record: dict) -> None:
        """The background evaluator, its curve carried over from the checkpoint resumed (`record`); a resumed step
        that was due and whose evaluation was lost with the previous process is evaluated again."""
        if not self.cfg.eval.every_steps:
            return
        p = self.parts

        def evaluate(step: int, params, progress) -> dict:
            return evaluate_heldout(self.cfg, p.engine, params, p.task, p.tokenizer, f"eval at step {step}",
                                    progress=progress)

        self.evaluator = InRunEvaluator(evaluate, self._record, self.cfg.eval.max_share, record.get("eval_curve"))
        self.evaluator.skipped = list(record.get("eval_skipped") or [])
        self.evaluator.errors = int(record.get("eval_errors") or 0)
        s = self.start_step  # step 0: eval_before's; the last step (a complete run resumed): when eval_after is off
        if s and evaluated_during_rl(self.cfg, s) and not self.evaluator.evaluated(s):
            self._submit_evaluation(s)

    def _submit_evaluation(self, step: int) -> None:
        """Hand the weights of `step` to the evaluator; a copy that cannot be made (device memory) is an evaluation
        error, logged and counted, not the run's."""
        try:
            self.evaluator.submit(step, self._snapshot())
        except Exception:  # noqa: BLE001 - evaluation never fails the run
            self.evaluator.errors += 1
            log.exception("the weights of step %d could not be handed to the evaluation; training goes on", step)

    def _drain_evaluations(self) -> None:
        """Until the evaluations still due end, their pauses lifted (nothing trains now; eval_after needs the
        engine), beating meanwhile: `up` restarts a trainer that stops beating."""
        while self.evaluator is not None and not self.evaluator.drain(timeout_s=5.0):
            if self.progress is not None:
                self.progress()

    def _snapshot(self):
        """A copy of the plain weights on their devices: the next update may donate (overwrite) the originals."""
        return jax.tree.map(jnp.copy, self.policy.plain(self.params))

    def _record(self, step: int, result: dict) -> None:
        """An evaluation's scalars to the hooks, on the step-report thread (one tracker record at a time)."""
        values = {**metric_values(result), "version": step}
        if self.evaluator is not None:
            values.update(errors=self.evaluator.errors, skipped=len(self.evaluator.skipped))

        def hand_over() -> None:
            try:
                self.hooks.evaluated(step, values)
            except Exception:  # noqa: BLE001 - an evaluation's report never fails the run
                log.exception("reporting the evaluation of step %d failed", step)

        self._reporter.submit(hand_over)

    def carried_now(self) -> dict:
        """What checkpoints and summary.json carry: the warm start's report, eval_before, the evaluation curve during
        RL so far (with its skipped versions and errors) and the hooks' run-long counts (CoreHooks.carried)."""
        state = {**(self.evaluator.state() if self.evaluator is not None else {}), **self.hooks.carried()}
        empty = {"eval_curve": [], "eval_skipped": [], "eval_errors": 0}
        kept = {k: v for k, v in self.carried.items() if v is not None or k not in empty}  # an older checkpoint's
        return {**empty, **kept, **state}

    # -- shared by the phases -----------------------------------------------------------------------------------
    def evaluate(self, label: str, step: int) -> dict | None:
        """eval_before (`step` 0) or eval_after, recorded; None when a stop (`warm_stop`) comes before or during it
        (it ends at its next group): a whole evaluation held the stop past up.stop_grace_s; a start again redoes it."""
        def progress() -> None:
            if self.warm_stop is not None and self.warm_stop.is_set():
                raise EvaluationCancelled(label)
            if self.progress is not None:
                self.progress()
        try:
            progress()
            p = self.parts
            result = evaluate_heldout(self.cfg, p.engine, self.policy.plain(self.params), p.task, p.tokenizer, label,
                                      progress=progress)
        except EvaluationCancelled:
            log.info("%s skipped: the trainer is stopping (a start again evaluates it)", label)
            return None
        self._record(step, result)
        return result

    def _export(self, name: str, what: str) -> None:
        """RUN_DIR/name as a Hugging Face directory: every process takes part in the gather, process 0 writes."""
        named = self.model.to_named_numpy(self.policy.plain(self.params))
        if not self.writes_files:
            return
        cfg, tokenizer = self.cfg, self.parts.tokenizer
        source = resolve_model_dir(cfg.model.path) if cfg.model.kind == "hf" else None
        if source is None:
            tokenizer.save(self.run_dir / name)  # the tiny model's own tokenizer (an hf source brings its own)
        export_hf(self.run_dir / name, self.model.arch, named, tokenizer_dir=source, dtype=cfg.model.dtype,
                  eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
        log.info("exported the %s model to %s", what, self.run_dir / name)

    def _publish(self, version: int, params, final: bool = False) -> None:
        stats = self.policy.publish(self.publisher, self.model, version, params, final)
        log.debug("published version %d (%.1f MB) in %.3fs", version, stats.nbytes / 1e6, stats.seconds)

    def state_report(self) -> dict:
        return state_report(self.updater, self.model.num_params(), self.policy.lora)

    def close(self, failed: bool = False) -> None:
        """Stop the background workers; after a failure without waiting (a stuck one must not hold the process)."""
        if self.evaluator is not None:
            self.evaluator.close()
        for worker in (self._books, self._worker, self._reporter):
            worker.shutdown(wait=not failed, cancel_futures=failed)
