"""The trainer process: ingest server, off-policy GRPO steps, weight publication, summary.

Versions: the weights published after RL step s carry version s (version 0
is the model when RL starts). While computing step s the trainer holds
version s-1, so a group generated with version v has staleness
(s - 1) - v; groups with staleness above `trainer.max_staleness` are
dropped, counted and logged, never trained on.

This module is the step loop (`_run`) and the set-up around it. Where a step's groups come from: collector.py;
exactly-once across crashes (checkpoints, acknowledgement, resume): durability.py; what a step reports:
step_report.py; evaluation, export and summary.json: run_outputs.py; the warm start: warmstart.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import threading
import time

import jax
import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine.evaluation import greedy_probe
from grpo_stream.common.engine import continuous
from grpo_stream.common.model.lora import LoraPolicy, apply_lora
from grpo_stream.common.model.sharding import make_mesh, place
from grpo_stream.common.rollouts.buffer import RUN_FILE
from grpo_stream.common.rollouts.redis_server import redacted
from grpo_stream.common.rollouts.trainer_lease import open_leased_buffer
from grpo_stream.common.rpc.grpc_util import ServerSecurity
from grpo_stream.common.runtime.process import build_policy, build_task_and_tokenizer, stop_on_signals
from grpo_stream.common.weights.registry import transport_spec, weight_sink
from grpo_stream.common.weights.snapshot import digest, new_epoch
from grpo_stream.common.weights.transport import SinkContext
from grpo_stream.trainer_service.batching import build_batch
from grpo_stream.trainer_service.checkpoints import TrainerCheckpoints
from grpo_stream.trainer_service.collector import GroupCollector
from grpo_stream.trainer_service.durability import Durability
from grpo_stream.trainer_service.ingest_server import ingest_servicers
from grpo_stream.trainer_service.metrics import MetricsWriter
from grpo_stream.trainer_service.multihost import TrainerGroup, ignore_signals, start_group
from grpo_stream.trainer_service.prompt_queue import PromptQueue
from grpo_stream.trainer_service.prompt_service import StatusWriter
from grpo_stream.trainer_service.publisher import WeightPublisher
from grpo_stream.trainer_service.rl_update import PolicyUpdater, donates_updates, state_report
from grpo_stream.trainer_service.run_outputs import evaluate_heldout, export_policy, write_summary
from grpo_stream.trainer_service.server import TrainerServer
from grpo_stream.trainer_service.step_report import StepReporter
from grpo_stream.trainer_service.warmstart import warm_start

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, devices=None, hub=None, group: TrainerGroup | None = None):
        """`devices`: the trainer mesh's devices (default: all); `hub`: in-process weight hub (transport local);
        `group`: this process's place in a multi-process trainer (trainer.processes > 1; this class runs process 0,
        follower.py the others)."""
        self.cfg, self.run_dir, self.group = cfg, run_dir, group
        self.devices, self.hub = devices, hub
        self.donate = donates_updates(transport_spec(cfg.weights.transport).in_process)
        self.stop_event = threading.Event()
        self.mixed_version_groups = 0  # trained groups whose completions mix weight versions (in-flight updates)
        self.started = time.time()
        self.agreement = {"tokens": 0.0, "abs_sum": 0.0, "max_abs": 0.0}
        self.step_times: list[dict[str, float]] = []  # per RL step: phase seconds and step_seconds
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-report")
        self._after_step: concurrent.futures.Future | None = None
        self.epoch = new_epoch()  # this trainer process; also the weight publisher's epoch
        self.resumed_from: dict | None = None
        self.final_weights: dict | None = None
        self.lora: LoraPolicy | None = None  # model.lora: the adapted model the updater trains
        self._base_published = False  # LoRA: the frozen base goes out once, before the first adapters-only version

    # -- set-up -----------------------------------------------------------------
    def _setup_model(self) -> None:
        """The task, tokenizer and model on the trainer's mesh (with trainer.processes > 1, over every process's
        devices), and the evaluation engine: what every trainer process holds."""
        cfg = self.cfg
        self.task, self.tokenizer = build_task_and_tokenizer(cfg)
        self.model = build_policy(cfg, self.tokenizer.vocab_size, seed=cfg.run.seed)
        m = cfg.trainer.mesh
        self.mesh = make_mesh(m.fsdp, m.tp, self.devices or jax.devices(), "trainer.mesh")
        self.params = place(self.model.params, self.mesh)
        log.info("trainer mesh %s on %s", dict(self.mesh.shape), [d.id for d in self.mesh.devices.flat])
        self.model = dataclasses.replace(self.model, params=self.params)
        log.info("model: %d parameters, vocab %d, tokenizer %s", self.model.num_params(), self.tokenizer.vocab_size,
                 self.tokenizer.fingerprint())
        self.engine = continuous.build(self.cfg, self.model, self.tokenizer)

    def _setup(self) -> None:
        cfg = self.cfg
        security = ServerSecurity.from_config(cfg)  # a missing token table or certificate fails before any wait
        self.buffer, self.lease = open_leased_buffer(cfg, self.stop_event)  # one trainer per run, before any write
        self.durability = Durability(cfg, self.buffer, TrainerCheckpoints(
            cfg.checkpoint.dir or str((self.run_dir / "checkpoints").resolve()), cfg.checkpoint.keep,
            cfg.checkpoint.verify), self.epoch, self.stop_event)
        self.checkpoints = self.durability.checkpoints
        # where `grpo-stream audit RUN_DIR` finds the trail (the password stays out of the file)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / RUN_FILE).write_text(json.dumps({"run": cfg.run.name, "redis_url": redacted(cfg.redis.url)}))
        self._setup_model()
        self.tokenizer.save(self.run_dir / "model")
        self.ingest, prompts = (None, None) if cfg.ingest.standalone else ingest_servicers(
            cfg, self.buffer, self.task, self.tokenizer, security)
        w, transport = cfg.weights, transport_spec(cfg.weights.transport)
        self.publisher = WeightPublisher(weight_sink(w.transport, SinkContext(w, self.hub)), w.transport, w.chunk_bytes,
                                         w.max_serve_mb_s, w.wire_dtype, epoch=self.epoch)
        tcp = transport.trainer_serves and w.data_plane == "tcp"
        self.server = TrainerServer(self.ingest, self.publisher, cfg.trainer.host, cfg.trainer.port,
                                    data_port=w.data_port if tcp else None, security=security, prompts=prompts)
        port = self.server.start()
        if self.group is not None:  # the manifest lists every process's slices, once all of them serve a version
            self.group.serve_versions(self.publisher, port, self.server.data.port if self.server.data else 0)
        self.status = StatusWriter(PromptQueue(self.buffer.client, cfg.run.name), self.publisher,
                                   cfg.trainer.steps).start()
        log.info("gRPC server (%sweights, health, reflection; auth %s%s) on %s:%d%s",
                 "" if cfg.ingest.standalone else "ingest, prompts, ", cfg.auth.mode, ", TLS" if cfg.tls.enabled else "",
                 cfg.trainer.host, port,
                 f"; weights data plane on port {self.server.data.port}" if tcp else "")
        self.collector = GroupCollector(self.buffer, cfg.trainer.groups_per_step, cfg.trainer.max_staleness,
                                        cfg.algo.dynamic_sampling, self.stop_event, self.durability.held)
        self.metrics = MetricsWriter(self.run_dir, "trainer")
        self.reporter = StepReporter(cfg, self.metrics, self.buffer, self.publisher, self.durability.held)

    def _adapted(self, params) -> bool:
        """Whether `params` are LoRA's adapted params (base and adapters), not yet the plain model's: before the
        adapters exist (warm start, eval_before) and without LoRA they are plain."""
        return self.lora is not None and jax.tree.structure(params) != jax.tree.structure(self.model.params)

    def _plain(self, params):
        """The plain model's params, what samplers, evaluation and export run: adapted params merged
        (W + alpha/rank A B), plain ones as they are."""
        return self._merge(params) if self._adapted(params) else params

    def _publish(self, version: int, params=None, final: bool = False) -> None:
        """Publish `params` (default: the trainer's) as `version`. With LoRA each version carries the adapters
        only, and the frozen base goes out once per trainer process before the first of them."""
        params = self.params if params is None else params
        if not self._adapted(params):
            stats = self.publisher.publish_arrays(version, self.model.named_arrays(params), final=final)
        else:
            base, adapters = self.lora.split_named(params)
            if not self._base_published:
                self.publisher.publish_base(base)
                self._base_published = True
            stats = self.publisher.publish_arrays(version, adapters, final=final, adapters=self._adapter_version)
        log.debug("published version %d (%.1f MB) in %.3fs", version, stats.nbytes / 1e6, stats.seconds)

    def _evaluate(self, label: str) -> dict:
        return evaluate_heldout(self.cfg, self.engine, self._plain(self.params), self.task, self.tokenizer, label)

    def _export_hf(self, name: str, what: str) -> None:
        export_policy(self.cfg, self.run_dir, name, what, self.model, self._plain(self.params), self.tokenizer)

    # -- the run ------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self._setup()
            summary = self._run()
        except BaseException:
            # a failed run must still release its gRPC threads, or the process never exits
            if getattr(self, "server", None) is not None:
                self.server.stop(grace_s=0)
            raise
        finally:
            self._worker.shutdown(wait=True)
            for part, closer in (("status", "stop"), ("checkpoints", "close"), ("reporter", "close"),
                                 ("lease", "release")):
                if getattr(self, part, None) is not None:
                    getattr(getattr(self, part), closer)()
        return summary

    def _updater(self) -> PolicyUpdater:
        """The updater of the plain params at hand (the warm-started or initial model): with model.lora, of the
        adapted model built around them, training the adapters only."""
        cfg = self.cfg
        t = cfg.trainer
        model, params, trainable = self.model.with_remat(t.remat), self.params, None
        if cfg.model.lora is not None:
            self.lora = apply_lora(model, self.params, cfg.model.lora, cfg.run.seed)
            self._merge = jax.jit(self.lora.merged)
            self._adapter_version = self.lora.adapter_version()
            model, params, trainable = self.lora.adapted, self.lora.adapted.params, self.lora.trainable()
            log.info("LoRA rank %d on %d weights: %d adapter parameters (%.2f%% of the model's) are trained",
                     cfg.model.lora.rank, len(self.lora.weights), self.lora.adapter_count(),
                     100 * self.lora.adapter_count() / self.model.num_params())
        return PolicyUpdater(model, params, cfg.algo, t.learning_rate, t.max_grad_norm, cfg.generation.temperature,
                             self.tokenizer.pad_id, self.mesh, t.optimizer, t.steps, t.micro_batch_size,
                             donate=self.donate, trainable=trainable)

    def _start(self) -> tuple[PolicyUpdater, int, dict]:
        """Resume from the newest valid checkpoint, or warm start and evaluate a new run; publish the weights.
        Returns (updater, the step the weights are at, what the checkpoints carry along)."""
        cfg = self.cfg
        resumed = None
        if self.group is not None:  # process 0 chooses the checkpoint every process restores (checkpoints.py)
            self.group.send("start", {"epoch": self.epoch, "restore": self.checkpoints.choose_step()})
        if self.checkpoints.steps():
            updater = self._updater()
            resumed = self.durability.resume(updater)
        if resumed is not None:
            state, record = resumed.state, resumed.record
            updater.params, updater.opt_state = state["params"], state["opt_state"]
            updater.ref_params = state.get("ref_params", updater.ref_params)
            self.params = updater.params
            self.resumed_from = {"step": resumed.step, "epoch": record["epoch"]}
            carried = {"warmstart": record.get("warmstart"), "eval_before": record.get("eval_before")}
            self.durability.available("auditing the start", lambda: self.buffer.log_trainer(
                self.epoch, resumed.step, record["epoch"]))
        else:
            trained = self.durability.available("reading the buffer counters", self.buffer.counters)["trained"]
            if trained:  # acknowledged groups exist only once a checkpoint held them: this run has one elsewhere
                raise ValueError(
                    f"Redis already holds run {cfg.run.name!r} with {trained} trained groups, but "
                    f"{self.checkpoints.directory} (checkpoint.dir) has no checkpoint of it: point checkpoint.dir "
                    "(or --run-dir) at that run's checkpoints to resume it, or choose a new run.name")
            warm = None
            if cfg.warmstart.steps:
                # several processes run the warm start in lockstep: a signal takes effect after it, at a step
                stop = self.stop_event if self.group is None else threading.Event()
                self.params, warm = warm_start(self.model, self.params, self.task, self.tokenizer, cfg, self.metrics,
                                              stop)
                if cfg.warmstart.export and not stop.is_set():
                    self._export_hf("warmstart-model", "warm-started")
            carried = {"warmstart": warm,
                       "eval_before": self._evaluate("eval_before") if cfg.trainer.eval_before else None}
            updater = self._updater()
            self.params = updater.params
            self.durability.available("auditing the start", lambda: self.buffer.log_trainer(self.epoch, 0, ""))
        self.durability.available("updating the held count", lambda: self.buffer.set_held(0))  # a dead one's count
        start = self.durability.resumed_step
        self._publish(start)
        self.status.step = start
        log.info("published weight version %d; RL %s", start, f"resumes at step {start + 1}" if resumed else "starts")
        return updater, start, carried

    def _run(self) -> dict:
        cfg = self.cfg
        updater, steps_done, carried = self._start()
        rl_start, saved, last_end = time.time(), steps_done, time.time()
        for step in range(steps_done + 1, cfg.trainer.steps + 1):
            # Phases of a step, from the end of the previous one: collect (wait for, read and decode groups),
            # batch, compute (the jitted update; its metrics are host values, so it has finished), then audit +
            # checkpoint, with publication and reporting handed to a worker thread.
            t0 = last_end
            if self.stop_event.is_set():  # SIGTERM: stop between steps even when groups are at hand
                break
            picked = self.collector.collect(step)
            if picked is None:
                break
            t_collect = time.time()
            groups = [g for _, g in picked]
            batch, stats = build_batch(groups, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens,
                                       self.tokenizer.pad_id, cfg.algo, held_version=step - 1)
            staleness = np.array([step - 1 - g.policy_version for g in groups])
            # what this step does besides the update; the other trainer processes are told, not left to work it out
            last = step == cfg.trainer.steps
            todo = {"checkpoint": step % cfg.checkpoint.every == 0 or last,
                    "publish": step % cfg.trainer.publish_every == 0 or last}
            self._share_batch(step, batch, todo)
            self.mixed_version_groups += sum(any(c.versions is not None and c.versions[0] != c.versions[-1]
                                                 for c in g.completions) for g in groups)
            t_batch = time.time()
            # the previous step's publication reads its parameters, which this update overwrites when donating
            if self._after_step is not None and self.donate:
                self._after_step.result()
            t_published = time.time()
            m = updater.update(batch)
            self.params = updater.params
            t_compute = time.time()
            self._track_agreement(m)
            self.durability.trained(step, picked)
            steps_done = self.status.step = step
            if todo["checkpoint"]:
                self.durability.checkpoint(step, updater, carried)
                saved = step
            self.durability.settle_committed()
            phases = {"collect_seconds": t_collect - t0, "batch_seconds": t_batch - t_collect,
                      "publish_wait_seconds": t_published - t_batch, "compute_seconds": t_compute - t_published}
            tokens_per_s, groups_per_s = self.reporter.rates(int(np.asarray(batch.loss_mask).sum()), len(groups))
            # Publication and reporting run on a worker thread while the next step collects and computes (XLA
            # releases the GIL); at most one step behind.
            if self._after_step is not None:
                self._after_step.result()
            self._after_step = self._worker.submit(self._publish_and_report, step, todo["publish"], self.params,
                                                   groups, staleness, stats, m, phases, tokens_per_s, groups_per_s)
            last_end = time.time()
            self.step_times.append({**phases, "handoff_seconds": last_end - t_compute, "step_seconds": last_end - t0})
        self._finish_background()
        return self._finish(updater, steps_done, saved, carried, time.time() - rl_start)

    def _finish(self, updater: PolicyUpdater, steps_done: int, saved: int, carried: dict, rl_seconds: float) -> dict:
        """Last checkpoint and acknowledgements; for a completed run also the final evaluation, export, final
        publication and the samplers' confirmation; then summary.json."""
        cfg = self.cfg
        complete = steps_done == cfg.trainer.steps
        final_publish = complete and (self.publisher.latest_version != steps_done
                                      or steps_done == self.durability.resumed_step)  # (a resumed complete run)
        if self.group is not None:  # the others mirror what follows (follower.py)
            self.group.send("finish", {"steps": steps_done, "complete": complete, "checkpoint": steps_done > saved,
                                       "publish": final_publish})
        if steps_done > saved:  # stopped by a signal between checkpoints: keep what was trained
            self.durability.checkpoint(steps_done, updater, carried)
        self.durability.settle_committed(wait=True, everything=complete)
        eval_after = None
        if not complete:  # SIGTERM/SIGINT: the run resumes later; samplers keep their weights and wait
            log.info("stopped at step %d with a checkpoint; start the trainer again to resume", steps_done)
            self.server.stop()
        else:
            eval_after = self._evaluate("eval_after") if cfg.trainer.eval_after else None
            self._export_hf("model", "trained")  # serve it, or `eval` it
            if final_publish:
                self._publish(steps_done, final=True)  # a resumed, already complete run: tell samplers to stop
            self._await_samplers(steps_done)
            if self.group is not None:  # the other processes may stop serving their slices
                self.group.send("done")
            self.server.stop()
            if cfg.weights.verify_prompts:
                problems = self.task.heldout(cfg.weights.verify_prompts)
                self.final_weights = {"version": self.publisher.latest_version,
                                      "sha256": digest(self.model.to_named_numpy(self._plain(self.params))),
                                      "greedy": greedy_probe(self.engine, self._plain(self.params), self.tokenizer,
                                                             problems, cfg.eval.batch_size)}
        counters = {**self.durability.available("reading the buffer counters", self.buffer.counters),
                    "trained_mixed_versions": self.mixed_version_groups}
        by_sampler = self.durability.available("reading the buffer counters", self.buffer.ingested_by_sampler)
        return write_summary(self.run_dir / "summary.json", cfg, steps=steps_done, counters=counters,
                             by_sampler=by_sampler, publisher=self.publisher, durability=self.durability,
                             agreement=self.agreement, mesh_shape=dict(self.mesh.shape),
                             final_weights=self.final_weights, carried=carried, eval_after=eval_after,
                             rl_seconds=rl_seconds, started=self.started, resumed_from=self.resumed_from,
                             trained_here=(steps_done - self.durability.resumed_step) * cfg.trainer.groups_per_step,
                             trainer_state=state_report(updater, self.model.num_params(), self.lora))

    def _share_batch(self, step: int, batch, todo: dict) -> None:
        """Send the step's batch to the other trainer processes (trainer.processes > 1) and, with
        trainer.record_batches, write it to RUN_DIR/batches."""
        if self.group is None and not self.cfg.trainer.record_batches:
            return
        arrays = {f.name: np.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
        if self.group is not None:
            self.group.send("step", {"step": step, **todo}, arrays)
        if self.cfg.trainer.record_batches:
            (self.run_dir / "batches").mkdir(exist_ok=True)
            np.savez(self.run_dir / "batches" / f"step-{step:06d}.npz", **arrays)

    def _track_agreement(self, m: dict) -> None:
        """Run-long sampler-trainer logprob agreement over tokens generated at version lag 0."""
        if m["fresh_tokens"]:
            a = self.agreement
            a["tokens"] += m["fresh_tokens"]
            a["abs_sum"] += m["logprob_diff_mean"] * m["fresh_tokens"]
            a["max_abs"] = max(a["max_abs"], m["logprob_diff_max"])

    def _publish_and_report(self, step, publish, params, groups, staleness, stats, m, phases, tokens_per_second,
                            groups_per_second) -> None:
        if publish:
            self._publish(step, params, final=step == self.cfg.trainer.steps)
        self.reporter.report(step, groups, staleness, stats, m, phases, tokens_per_second, groups_per_second)

    def _finish_background(self) -> None:
        """Wait for the last step's publication and report; re-raise what failed there."""
        if self._after_step is not None:
            future, self._after_step = self._after_step, None
            future.result()

    def _await_samplers(self, final_version: int) -> None:
        """Until every sampler installed the final version (so each stops by itself), or trainer.final_wait_s.
        Every one means at least sampler.replicas: a restarted trainer knows only the samplers that reported to it
        since, and one backing off after the restart (up to 10 s) would otherwise be left behind, never told."""
        deadline = time.time() + self.cfg.trainer.final_wait_s
        while time.time() < deadline and not self.stop_event.is_set():
            at = self.publisher.samplers_at(final_version)
            if at and all(at.values()) and len(at) >= self.cfg.sampler.replicas:
                log.info("every sampler (%d) installed the final version %d", len(at), final_version)
                return
            time.sleep(0.2)
        log.warning("samplers not at final version %d after %.0fs: %s", final_version, self.cfg.trainer.final_wait_s,
                    self.publisher.samplers_at(final_version))


def run_trainer(cfg: RunConfig, run_dir: pathlib.Path) -> dict | None:
    """Run this trainer process; the summary (None on trainer processes other than 0 of a multi-process trainer)."""
    group = start_group(cfg)
    if group is not None and not group.leader:
        from grpo_stream.trainer_service.follower import FollowerTrainer  # noqa: PLC0415

        # a signal stops the job through process 0, which tells the others: alone, one would leave the rest waiting
        ignore_signals()
        FollowerTrainer(cfg, run_dir, group=group).run()
        return None
    trainer = Trainer(cfg, run_dir, group=group)
    stop_on_signals(trainer.stop_event, "step")
    return trainer.run()
