"""Trainer processes 1..N-1 of a multi-process trainer (trainer.processes > 1; multihost.py says how it works).

A follower holds its shards, runs every program process 0 runs in the same order, serves its slices of each
weight version, and saves its part of each checkpoint (Orbax writes every process's shards into the one
checkpoint). It has no buffer, ingest or status: the steps' batches and the run's end come from process 0. Every
method here mirrors one of loop.py's `Trainer`, and must launch the same collectives in the same order.
"""

from __future__ import annotations

import logging

from grpo_stream.common.engine.evaluation import greedy_probe
from grpo_stream.common.rpc.grpc_util import ServerSecurity
from grpo_stream.common.weights.registry import weight_sink
from grpo_stream.common.weights.transport import SinkContext
from grpo_stream.trainer_service.batching import TrainBatch
from grpo_stream.trainer_service.checkpoints import TrainerCheckpoints
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
        fields, _ = self.group.receive()
        assert fields["kind"] == "start", fields
        self.epoch = self.publisher.epoch = fields["epoch"]  # the versions are process 0's
        restored, start = None, 0
        if self.checkpoints.steps():
            updater = self._updater()
            restored = self.checkpoints.restore_latest(updater_state(updater))
        if restored is not None:
            state = restored.state
            updater.params, updater.opt_state = state["params"], state["opt_state"]
            updater.ref_params = state.get("ref_params", updater.ref_params)
            self.params, start = updater.params, restored.step
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
        self._publish(start)
        return updater, start, {}

    def _run(self) -> dict:
        cfg = self.cfg
        updater, steps_done, _ = self._start()
        while True:
            fields, arrays = self.group.receive()
            if fields["kind"] != "step":
                break
            step = fields["step"]
            if self._after_step is not None and self.donate:  # as process 0: publication reads the old params
                self._after_step.result()
            updater.update(TrainBatch(**arrays))
            self.params = updater.params
            steps_done = step
            if fields["checkpoint"]:
                self.checkpoints.save(step, updater_state(updater), {"process": self.group.index})
            self.checkpoints.committed()
            if self._after_step is not None:
                self._after_step.result()
            if fields["publish"]:
                self._after_step = self._worker.submit(self._publish, step, self.params,
                                                       final=step == cfg.trainer.steps)
        assert fields["kind"] == "finish" and fields["steps"] == steps_done, (fields, steps_done)
        self._finish_background()
        return self._finish_follower(updater, fields)

    def _finish_follower(self, updater: PolicyUpdater, finish: dict) -> dict:
        """Mirrors Trainer._finish: the last checkpoint, and for a completed run the final evaluation, export and
        publication, serving until process 0 says every sampler has the final version, then the final check."""
        cfg, steps_done = self.cfg, finish["steps"]
        if finish["checkpoint"]:
            self.checkpoints.save(steps_done, updater_state(updater), {"process": self.group.index})
        self.checkpoints.committed(wait=True)
        if not finish["complete"]:
            self.server.stop()
            return {}
        if cfg.trainer.eval_after:
            self._evaluate("eval_after")
        self.model.to_named_numpy(self._plain(self.params))  # process 0 exports: its gathers need every process
        if finish["publish"]:
            self._publish(steps_done, final=True)
        fields, _ = self.group.receive()
        assert fields["kind"] == "done", fields
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
        except BaseException:
            if getattr(self, "server", None) is not None:  # its threads would keep the process alive
                self.server.stop(grace_s=0)
            raise
        finally:
            self._worker.shutdown(wait=True)
            if getattr(self, "checkpoints", None) is not None:
                self.checkpoints.close()
