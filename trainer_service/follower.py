"""Trainer processes 1..N-1 of a multi-process trainer (trainer.processes > 1; multihost.py says how it works).

A follower holds its shards, runs every program process 0 runs in the same order, serves its slices of each
weight version, and saves its part of each checkpoint (Orbax writes every process's shards into the one
checkpoint). It has no buffer, ingest or status: the steps' batches and the run's end come from process 0. Every
method here mirrors one of loop.py's `Trainer`, and must launch the same collectives in the same order. It checks
what it receives (typed, sealed messages in protocol order; the step process 0 chose to restore) and, on any error,
ends at once (`stop_now`) so that the job stops instead of waiting for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from grpo_stream.common.engine.evaluation import greedy_probe
from grpo_stream.common.rpc.grpc_util import ServerSecurity
from grpo_stream.common.weights.registry import weight_sink
from grpo_stream.common.weights.transport import SinkContext
from grpo_stream.trainer_service.batching import TrainBatch
from grpo_stream.trainer_service.checkpoints import TrainerCheckpoints
from grpo_stream.trainer_service.control_messages import ControlMessageError, Finish
from grpo_stream.trainer_service.durability import updater_state
from grpo_stream.trainer_service.loop import Trainer
from grpo_stream.trainer_service.metrics import MetricsWriter
from grpo_stream.trainer_service.multihost import advertised_host
from grpo_stream.trainer_service.publisher import WeightPublisher
from grpo_stream.trainer_service.rl_update import PolicyUpdater
from grpo_stream.trainer_service.server import TrainerServer
from grpo_stream.trainer_service.warmstart import warm_start

log = logging.getLogger(__name__)


class FollowerTrainer(Trainer):
    def _setup(self) -> None:
        cfg, index = self.cfg, self.group.index
        self.checkpoints = TrainerCheckpoints(cfg.checkpoint.dir or str((self.run_dir / "checkpoints").resolve()),
                                              cfg.checkpoint.keep, cfg.checkpoint.verify)
        self._setup_model()
        w = cfg.weights
        self.publisher = WeightPublisher(weight_sink(w.transport, SinkContext(w)), w.transport, w.chunk_bytes,
                                         w.max_serve_mb_s, w.wire_dtype)
        # process 0's ports on a host of its own; processes sharing a machine (advertised on loopback, as `up` runs
        # them) take trainer.port + index and weights.data_port + index
        offset = index if advertised_host().startswith("127.") else 0
        self.server = TrainerServer(None, self.publisher, cfg.trainer.host, cfg.trainer.port + offset if
                                    cfg.trainer.port else 0, security=ServerSecurity.from_config(cfg),
                                    data_port=(w.data_port + offset if w.data_port else 0) if w.data_plane == "tcp"
                                    else None)
        port = self.server.start()
        self.group.serve_versions(self.publisher, port, self.server.data.port if self.server.data else 0)
        self.metrics = MetricsWriter(self.run_dir, f"trainer-{index}")  # its warm start's own curve
        log.info("trainer process %d serves its weight slices on port %d", index, port)

    def _start(self) -> tuple[PolicyUpdater, int, dict]:
        cfg = self.cfg
        start, _ = self.group.receive("start")
        self.epoch = self.publisher.epoch = start.epoch  # the versions are process 0's
        # the step to restore is process 0's choice, whatever this process lists (checkpoints.py: choose_step)
        self.checkpoints.agree_step(start.restore)
        restored, start_step = None, 0
        if start.restore is not None:
            updater = self._updater()
            restored = self.checkpoints.restore_latest(updater_state(updater))
        if restored is not None:
            state = restored.state
            updater.params, updater.opt_state = state["params"], state["opt_state"]
            updater.ref_params = state.get("ref_params", updater.ref_params)
            self.params, start_step = updater.params, restored.step
        else:
            if cfg.warmstart.steps:
                self.params, _ = warm_start(self.model, self.params, self.task, self.tokenizer, cfg, self.metrics,
                                            self.stop_event)
                if cfg.warmstart.export:  # process 0 exports the warm-started model: its gathers need every process
                    self.model.to_named_numpy(self.params)
            if cfg.trainer.eval_before:
                self._evaluate("eval_before")
            updater = self._updater()
            self.params = updater.params
        self._publish(start_step)
        return updater, start_step, {}

    def _run(self) -> dict:
        cfg = self.cfg
        updater, steps_done, _ = self._start()
        while True:
            message, arrays = self.group.receive("step", "finish")
            if message.kind == "finish":
                break
            step = message.step
            if step != steps_done + 1:
                raise ControlMessageError(f"trainer process {self.group.index}: process 0 sent step {step} after "
                                          f"step {steps_done}")
            batch = train_batch(arrays)
            if self._after_step is not None and self.donate:  # as process 0: publication reads the old params
                self._after_step.result()
            updater.update(batch)
            self.params = updater.params
            steps_done = step
            if message.checkpoint:
                self.checkpoints.save(step, updater_state(updater), {"process": self.group.index})
            self.checkpoints.committed()
            if self._after_step is not None:
                self._after_step.result()
            if message.publish:
                self._after_step = self._worker.submit(self._publish, step, self.params,
                                                       final=step == cfg.trainer.steps)
        if message.steps != steps_done:
            raise ControlMessageError(f"trainer process {self.group.index}: process 0 finished at step "
                                      f"{message.steps}, this process is at step {steps_done}")
        self._finish_background()
        return self._finish_follower(updater, message)

    def _finish_follower(self, updater: PolicyUpdater, finish: Finish) -> dict:
        """Mirrors Trainer._finish: the last checkpoint, and for a completed run the final evaluation, export and
        publication, serving until process 0 says every sampler has the final version, then the final check."""
        cfg, steps_done = self.cfg, finish.steps
        if finish.checkpoint:
            self.checkpoints.save(steps_done, updater_state(updater), {"process": self.group.index})
        self.checkpoints.committed(wait=True)
        if not finish.complete:
            self.server.stop()
            return {}
        if cfg.trainer.eval_after:
            self._evaluate("eval_after")
        self.model.to_named_numpy(self._plain(self.params))  # process 0 exports: its gathers need every process
        if finish.publish:
            self._publish(steps_done, final=True)
        self.group.receive("done")
        self.server.stop()
        if cfg.weights.verify_prompts:
            self.model.to_named_numpy(self._plain(self.params))
            greedy_probe(self.engine, self._plain(self.params), self.tokenizer,
                         self.task.heldout(cfg.weights.verify_prompts), cfg.eval.batch_size)
        log.info("trainer process %d done at step %d", self.group.index, steps_done)
        return {}

    def run(self) -> dict:
        try:
            self._setup()
            return self._run()
        except BaseException as exc:
            if getattr(self, "server", None) is not None:  # its threads would keep the process alive
                self.server.stop(grace_s=0)
            stop_now(self.group.index, exc)
            raise
        finally:
            self._worker.shutdown(wait=True)
            if getattr(self, "checkpoints", None) is not None:
                self.checkpoints.close()


def train_batch(arrays: dict) -> TrainBatch:
    """The step's batch from process 0's arrays: exactly TrainBatch's fields."""
    names = {f.name for f in dataclasses.fields(TrainBatch)}
    if set(arrays) != names:
        raise ControlMessageError(f"a step message from trainer process 0 holds arrays {sorted(arrays)}, not "
                                  f"{sorted(names)}: the processes run different versions of grpo-stream")
    return TrainBatch(**arrays)


def stop_now(index: int, exc: BaseException) -> None:
    """End this process at once after an error that process 0 did not cause (a forged message, a checkpoint it
    cannot read): process 0 waits for it in a collective or a barrier, and JAX's at-exit shutdown would wait for
    process 0 at another barrier for up to 5 minutes, so `up` (or a JobSet) would see a live process and a job that
    hangs. Exiting lets the supervisor stop the job and restart it from its newest checkpoint."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return
    log.error("trainer process %d stops: %s: %s", index, type(exc).__name__, exc, exc_info=exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
