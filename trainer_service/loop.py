"""The trainer process: ingest server, off-policy GRPO steps, weight publication, summary.

Versions: the weights published after RL step s carry version s (version 0
is the model when RL starts). While computing step s the trainer holds
version s-1, so a group generated with version v has staleness
(s - 1) - v; groups with staleness above `trainer.max_staleness` are
dropped, counted and logged, never trained on.

Durability: every `checkpoint.every` steps the trainer saves its whole state (Orbax, asynchronously). The
groups of a step are acknowledged in the buffer only after the checkpoint *after* the one holding their
update is on disk, so a crash, or a corrupt newest checkpoint, replays them from the buffer instead of
losing them; a restarted trainer resumes from the newest valid checkpoint and first settles the groups
that checkpoint already holds. The audit trail (`grpo-stream audit`) checks the result.
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

from grpo_stream.common.rollouts.buffer import RUN_FILE, BufferEntry, BufferUnavailable, RedisStreamBuffer
from grpo_stream.common.weights.snapshot import new_epoch
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine.evaluation import evaluate
from grpo_stream.common.engine.jax_engine import Engine
from grpo_stream.common.rpc.grpc_util import ServerSecurity
from grpo_stream.trainer_service.prompt_queue import PromptQueue
from grpo_stream.common.model.hf_checkpoint import export_hf, resolve_model_dir
from grpo_stream.trainer_service.metrics import MetricsWriter
from grpo_stream.common.runtime.prometheus import ServiceMetrics
from grpo_stream.common.rollouts.redis_server import connect, credentials, redacted
from grpo_stream.common.runtime.process import build_policy, build_task_and_tokenizer, stop_on_signals
from grpo_stream.common.engine.evaluation import greedy_probe
from grpo_stream.common.model.sharding import make_mesh, place
from grpo_stream.common.weights.checkpoint_store import CheckpointWeightStore
from grpo_stream.common.weights.snapshot import digest
from grpo_stream.common.rollouts.wire import GroupData, decode_group
from grpo_stream.trainer_service.batching import build_batch
from grpo_stream.trainer_service.ingest_server import ingest_servicers
from grpo_stream.trainer_service.prompt_service import StatusWriter
from grpo_stream.trainer_service.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer
from grpo_stream.trainer_service.rl_update import PolicyUpdater
from grpo_stream.trainer_service.checkpoints import TrainerCheckpoints
from grpo_stream.trainer_service.selection import select_batch
from grpo_stream.trainer_service.warmstart import warm_start

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, devices=None, hub=None):
        """`devices`: the trainer mesh's devices (default: all); `hub`: in-process weight hub (transport local)."""
        self.cfg, self.run_dir = cfg, run_dir
        self.devices, self.hub = devices, hub
        self.stop_event = threading.Event()
        self.started = time.time()
        self.pending: list[tuple[BufferEntry, GroupData]] = []
        self.agreement = {"tokens": 0.0, "abs_sum": 0.0, "max_abs": 0.0}
        self.step_times: list[dict[str, float]] = []  # per RL step: phase seconds and step_seconds
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-report")
        self._after_step: concurrent.futures.Future | None = None
        self.epoch = new_epoch()  # this trainer process; also the weight publisher's epoch
        self.unsettled: list[tuple[int, list[tuple[str, str]]]] = []  # (step, [(entry id, group id)]) not acked
        self.checkpointed: list[int] = []  # steps whose checkpoint is committed, by this process
        self.resumed_from: dict | None = None
        self.data_position: dict[str, int] = {}  # sampler -> highest data position trained
        self.buffer_position = "0-0"  # newest stream entry trained
        self._counters: dict[str, int] = {}

    # -- set-up -----------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.cfg
        if cfg.redis.url is None:
            raise ValueError("redis.url is null: give the buffer's Redis URL (e.g. redis.url=redis://host:6379/0), "
                             "or run `grpo-stream up`, which starts an embedded Redis")
        security = ServerSecurity.from_config(cfg)  # a missing token table or certificate fails before any wait
        client = connect(cfg.redis.url, cfg.redis.connect_timeout_s, **credentials(cfg.redis))
        self.buffer = RedisStreamBuffer(client, cfg.run.name)
        # where `grpo-stream audit RUN_DIR` finds the trail (the password stays out of the file)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / RUN_FILE).write_text(json.dumps({"run": cfg.run.name, "redis_url": redacted(cfg.redis.url)}))
        self.checkpoints = TrainerCheckpoints(cfg.checkpoint.dir or str((self.run_dir / "checkpoints").resolve()),
                                              cfg.checkpoint.keep, cfg.checkpoint.verify)
        self.task, self.tokenizer = build_task_and_tokenizer(cfg)
        self.tokenizer.save(self.run_dir / "model")
        self.model = build_policy(cfg, self.tokenizer.vocab_size, seed=cfg.run.seed)
        m = cfg.trainer.mesh
        self.mesh = make_mesh(m.fsdp, m.tp, self.devices or jax.devices(), "trainer.mesh")
        self.params = place(self.model.params, self.mesh)
        log.info("trainer mesh %s on %s", dict(self.mesh.shape), [d.id for d in self.mesh.devices.flat])
        self.model = dataclasses.replace(self.model, params=self.params)
        log.info("model: %d parameters, vocab %d, tokenizer %s", self.model.num_params(), self.tokenizer.vocab_size,
                 self.tokenizer.fingerprint())
        gen = cfg.generation
        self.engine = Engine(self.model, self.tokenizer.pad_id, self.tokenizer.eos_ids, gen.max_prompt_tokens,
                             gen.max_new_tokens, gen.temperature)
        self.ingest, prompts = (None, None) if cfg.ingest.standalone else ingest_servicers(
            cfg, self.buffer, self.task, self.tokenizer, security)
        w = cfg.weights
        if w.transport == "checkpoint" and not w.checkpoint_dir:
            raise ValueError("weights.transport=checkpoint needs weights.checkpoint_dir: a directory every sampler "
                             "can read (shared disk or gs://); `up` uses RUN_DIR/weights")
        if w.transport == "local" and self.hub is None:
            raise ValueError("weights.transport=local runs the samplers inside the trainer's process: start the run "
                             "with `grpo-stream up` (or `grpo-stream colocated`), or choose grpc / checkpoint")
        store = CheckpointWeightStore(w.checkpoint_dir, w.keep_versions) if w.transport == "checkpoint" else None
        self.publisher = WeightPublisher(w.transport, w.chunk_bytes, w.max_serve_mb_s, store, self.hub,
                                         w.wire_dtype, epoch=self.epoch)
        tcp = w.transport == "grpc" and w.data_plane == "tcp"
        self.server = TrainerServer(self.ingest, self.publisher, cfg.trainer.host, cfg.trainer.port,
                                    data_port=w.data_port if tcp else None, security=security, prompts=prompts,
                                    workers=16 + cfg.prompts.max_followers)
        port = self.server.start()
        self.status = StatusWriter(PromptQueue(self.buffer.client, cfg.run.name), self.publisher,
                                   cfg.trainer.steps).start()
        log.info("gRPC server (%sweights, health, reflection; auth %s%s) on %s:%d%s",
                 "" if cfg.ingest.standalone else "ingest, prompts, ", cfg.auth.mode, ", TLS" if cfg.tls.enabled else "",
                 cfg.trainer.host, port,
                 f"; weights data plane on port {self.server.data.port}" if tcp else "")
        self.metrics = MetricsWriter(self.run_dir, "trainer")
        self.prom = ServiceMetrics("trainer")
        self.gauges = {name: self.prom.gauge(name, doc) for name, doc in (
            ("trainer_step", "RL steps completed"), ("weight_version", "latest published weight version"),
            ("buffer_depth", "groups waiting in the buffer to be trained"),
            ("reward_mean", "mean reward of the last batch"),
            ("accuracy", "answer accuracy of the last batch"), ("staleness_mean", "mean staleness of the last batch"),
            ("step_seconds", "wall time of the last step"), ("wait_seconds", "time the last step waited for data"),
            ("tokens_per_second", "completion tokens trained per second"),
            ("groups_per_second", "rollout groups trained per second"),
            ("compute_share", "share of the last step's wall time spent in the jitted update"))}
        self.groups_gauge = self.prom.gauge("groups", "rollout groups by outcome (buffer counters)", ("outcome",))
        self.lag_gauge = self.prom.gauge("sampler_weight_lag", "latest version minus the sampler's installed version",
                                         ("sampler",))
        self.prom.start(cfg.trainer.host, cfg.trainer.metrics_port)

    def _publish(self, version: int, params=None, final: bool = False) -> None:
        params = self.params if params is None else params
        stats = self.publisher.publish_arrays(version, self.model.named_arrays(params), final=final)
        log.debug("published version %d (%.1f MB) in %.3fs", version, stats.nbytes / 1e6, stats.seconds)

    def _evaluate(self, label: str) -> dict:
        problems = self.task.heldout(self.cfg.eval.num_problems)
        result = evaluate(self.engine, self.params, self.tokenizer, problems, self.cfg.eval.batch_size,
                          samples=self.cfg.eval.samples, ks=self.cfg.eval.ks, seed=self.cfg.run.seed)
        log.info("%s: held-out greedy accuracy %.3f on %d problems (%.1fs); e.g. %r", label, result.accuracy,
                 result.num_problems, result.seconds, result.examples[0]["completion"] if result.examples else "")
        return result.as_dict()

    # -- consuming the buffer -----------------------------------------------------
    def _redis(self, what: str, fn):
        """fn() once Redis answers: while it is down (restarting, failing over) wait with back-off, logging."""
        delay = 0.5
        while True:
            try:
                return fn()
            except BufferUnavailable as exc:
                log.error("%s: Redis unavailable (%s); retrying in %.1fs", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _collect(self, step: int) -> list[tuple[BufferEntry, GroupData]] | None:
        """groups_per_step usable groups in stream order; drops the stale / zero-variance ones it passes over.
        None when stopping."""
        need, holding = self.cfg.trainer.groups_per_step, self.cfg.trainer.max_staleness
        last_note = time.time()
        while True:
            batch, stale, flat, rest = select_batch(self.pending, need, step - 1, holding,
                                                    self.cfg.algo.dynamic_sampling)
            if stale or flat:
                self._redis("settling dropped groups", lambda: self.buffer.settle(
                    [(e.entry_id, e.group_id, "dropped_stale", step) for e, _ in stale]
                    + [(e.entry_id, e.group_id, "dropped_filtered", step) for e, _ in flat]))
            if stale:
                log.info("dropped %d stale groups (versions %s, trainer at %d, max_staleness %d)", len(stale),
                         sorted({g.policy_version for _, g in stale}), step - 1, holding)
            if len(batch) == need:
                self.pending = rest
                return batch
            self.pending = batch
            if self.stop_event.is_set():
                return None
            try:
                entries = self.buffer.read(max_count=need * 2, block_ms=500)
            except BufferUnavailable as exc:
                log.error("buffer read failed: Redis unavailable (%s); retrying in 1s", exc)
                time.sleep(1.0)
                continue
            undecodable = []
            for entry in entries:
                try:
                    self.pending.append((entry, decode_group(entry.payload)))
                except Exception as exc:  # noqa: BLE001 - a corrupt entry must not stop training
                    log.error("undecodable buffer entry %s dropped: %s", entry.entry_id, exc)
                    undecodable.append((entry.entry_id, entry.group_id, "dropped_invalid", step))
            if undecodable:
                self._redis("settling undecodable groups", lambda: self.buffer.settle(undecodable))
            if time.time() - last_note > 10:
                log.info("step %d waiting for rollouts: %d/%d groups, %d more waiting in the buffer", step,
                         len(self.pending), need,
                         self._redis("reading the buffer depth", self.buffer.depth) - self._held() - len(self.pending))
                last_note = time.time()

    # -- checkpoints --------------------------------------------------------------
    def _state(self, updater: PolicyUpdater) -> dict:
        state = {"params": updater.params, "opt_state": updater.opt_state}
        if updater.ref_params is not None:  # the KL reference is the policy RL started from, not the resumed one
            state["ref_params"] = updater.ref_params
        return state

    def _checkpoint(self, step: int, updater: PolicyUpdater, extra: dict) -> None:
        """Start saving `step`; its groups and everything before are listed so a resume can settle them."""
        unsettled = [[eid, gid, s] for s, pairs in self.unsettled if s <= step for eid, gid in pairs]
        self.checkpoints.save(step, self._state(updater), {
            "run": self.cfg.run.name, "epoch": self.epoch, "weight_version": step, "unsettled": unsettled,
            "data_position": dict(self.data_position), "buffer_position": self.buffer_position, **extra},
            token=step)

    def _settle_committed(self, wait: bool = False, everything: bool = False) -> None:
        """Acknowledge groups whose update is safe on disk: those of steps up to the checkpoint *before* the newest
        committed one (so a corrupt newest checkpoint still finds its groups in the buffer), or, at the end of a
        completed run (`everything`), up to the newest."""
        for step, _ in self.checkpoints.committed(wait=wait):
            self._redis("auditing a checkpoint", lambda: self.buffer.log_checkpoint(self.epoch, step))
            self.checkpointed.append(step)
            log.info("checkpoint of step %d saved", step)
        if not self.checkpointed:
            return
        upto = self.checkpointed[-1] if everything else (self.checkpointed[-2] if len(self.checkpointed) > 1
                                                          else self.resumed_step)
        done = [(s, pairs) for s, pairs in self.unsettled if s <= upto]
        if done:
            self._redis("acknowledging trained groups", lambda: self.buffer.settle(
                (eid, gid, "trained", s) for s, pairs in done for eid, gid in pairs))
            self.unsettled = [(s, pairs) for s, pairs in self.unsettled if s > upto]
            self._redis("updating the held count", lambda: self.buffer.set_held(self._held()))

    def _held(self) -> int:
        return sum(len(pairs) for _, pairs in self.unsettled)

    def _resume(self, updater_like: dict) -> dict | None:
        """Restore the newest valid checkpoint (there is at least one) into the trainer mesh and settle the groups it
        holds; None when every one was unusable."""
        cfg = self.cfg
        if not cfg.checkpoint.resume:
            raise ValueError(f"checkpoint.dir {self.checkpoints.directory} holds checkpoints (steps "
                             f"{self.checkpoints.steps()}) and checkpoint.resume=false: choose a new checkpoint.dir "
                             "(and run.name) or resume")
        restored = self.checkpoints.restore_latest(updater_like)
        if restored is None:
            return None
        record = restored.record
        if record.get("run") != cfg.run.name:
            raise ValueError(f"checkpoint.dir {self.checkpoints.directory}: its checkpoints belong to run "
                             f"{record.get('run')!r}, not run.name={cfg.run.name!r}; use that run's name or another "
                             "dir")
        settled = self._redis("settling the resumed checkpoint's groups", lambda: self.buffer.settle(
            (eid, gid, "trained", s) for eid, gid, s in record["unsettled"]))
        self.data_position = dict(record.get("data_position", {}))
        self.buffer_position = record.get("buffer_position", "0-0")
        log.info("resumed at step %d (written by trainer %s); acknowledged %d groups it already held", restored.step,
                 record["epoch"], settled)
        return {"step": restored.step, "state": restored.state, "record": record}

    # -- the run ------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
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
            if getattr(self, "status", None) is not None:
                self.status.stop()
            if getattr(self, "checkpoints", None) is not None:
                self.checkpoints.close()
            for part in ("metrics", "prom"):
                closer = getattr(getattr(self, part, None), "close" if part == "metrics" else "stop", None)
                if closer is not None:
                    closer()
        return summary

    def _updater(self) -> PolicyUpdater:
        cfg = self.cfg
        return PolicyUpdater(self.model, self.params, cfg.algo, cfg.trainer.learning_rate, cfg.trainer.max_grad_norm,
                             cfg.generation.temperature, self.tokenizer.pad_id, self.mesh)

    def _start(self) -> tuple[PolicyUpdater, int, dict]:
        """Resume from the newest valid checkpoint, or warm start and evaluate a new run; publish the weights.
        Returns (updater, the step the weights are at, what the checkpoints carry along)."""
        cfg = self.cfg
        resumed = None
        if self.checkpoints.steps():
            updater = self._updater()
            resumed = self._resume(self._state(updater))
        if resumed is not None:
            state, record = resumed["state"], resumed["record"]
            updater.params, updater.opt_state = state["params"], state["opt_state"]
            updater.ref_params = state.get("ref_params", updater.ref_params)
            self.params, self.resumed_step = updater.params, resumed["step"]
            self.resumed_from = {"step": resumed["step"], "epoch": record["epoch"]}
            carried = {"warmstart": record.get("warmstart"), "eval_before": record.get("eval_before")}
            self._redis("auditing the start", lambda: self.buffer.log_trainer(self.epoch, resumed["step"],
                                                                              record["epoch"]))
        else:
            trained = self._redis("reading the buffer counters", self.buffer.counters)["trained"]
            if trained:  # acknowledged groups exist only once a checkpoint held them: this run has one elsewhere
                raise ValueError(
                    f"Redis already holds run {cfg.run.name!r} with {trained} trained groups, but "
                    f"{self.checkpoints.directory} (checkpoint.dir) has no checkpoint of it: point checkpoint.dir "
                    "(or --run-dir) at that run's checkpoints to resume it, or choose a new run.name")
            self.resumed_step = 0
            warm = None
            if cfg.warmstart.steps:
                self.params, warm = warm_start(self.model, self.params, self.task, self.tokenizer, cfg, self.metrics,
                                              self.stop_event)
                if cfg.warmstart.export and not self.stop_event.is_set():
                    self._export_hf("warmstart-model", "warm-started")
            carried = {"warmstart": warm,
                       "eval_before": self._evaluate("eval_before") if cfg.trainer.eval_before else None}
            updater = self._updater()
            self._redis("auditing the start", lambda: self.buffer.log_trainer(self.epoch, 0, ""))
        self._redis("updating the held count", lambda: self.buffer.set_held(0))  # a dead predecessor's count
        self._publish(self.resumed_step)
        self.status.step = self.resumed_step
        log.info("published weight version %d; RL %s", self.resumed_step,
                 f"resumes at step {self.resumed_step + 1}" if resumed else "starts")
        return updater, self.resumed_step, carried

    def _run(self) -> dict:
        cfg = self.cfg
        updater, steps_done, carried = self._start()
        algo = cfg.algo
        rl_start, tokens_total, groups_total, saved = time.time(), 0, 0, steps_done
        last_end = time.time()
        for step in range(steps_done + 1, cfg.trainer.steps + 1):
            # Phases of a step, from the end of the previous one: collect (wait for,
            # read and decode groups), batch, compute (the jitted update; its metrics
            # are host values, so it has finished), then audit + checkpoint + publish + report.
            t0 = last_end
            if self.stop_event.is_set():  # SIGTERM: stop between steps even when groups are at hand
                break
            picked = self._collect(step)
            if picked is None:
                break
            t_collect = time.time()
            groups = [g for _, g in picked]
            batch, stats = build_batch(groups, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens,
                                       self.tokenizer.pad_id, algo, held_version=step - 1)
            staleness = np.array([step - 1 - g.policy_version for g in groups])
            t_batch = time.time()
            m = updater.update(batch)
            self.params = updater.params
            t_compute = time.time()
            self._track_agreement(m)
            self._redis("auditing a step",
                        lambda: self.buffer.log_step(self.epoch, step, [e.group_id for e, _ in picked]))
            self.unsettled.append((step, [(e.entry_id, e.group_id) for e, _ in picked]))
            self._redis("updating the held count", lambda: self.buffer.set_held(self._held()))
            self._note_positions(picked)
            steps_done = self.status.step = step
            if step % cfg.checkpoint.every == 0 or step == cfg.trainer.steps:
                self._checkpoint(step, updater, carried)
                saved = step
            self._settle_committed()
            tokens_total += int(np.asarray(batch.loss_mask).sum())
            groups_total += len(groups)
            elapsed = max(time.time() - rl_start, 1e-9)
            phases = {"collect_seconds": t_collect - t0, "batch_seconds": t_batch - t_collect,
                      "compute_seconds": t_compute - t_batch}
            # Publication and reporting run on a worker thread while the next step
            # collects and computes (XLA releases the GIL); at most one step behind.
            if self._after_step is not None:
                self._after_step.result()
            self._after_step = self._worker.submit(
                self._publish_and_report, step, self.params, groups, staleness, stats, m, phases,
                tokens_total / elapsed, groups_total / elapsed)
            last_end = time.time()
            self.step_times.append({**phases, "handoff_seconds": last_end - t_compute, "step_seconds": last_end - t0})
        self._finish_background()
        rl_seconds = time.time() - rl_start
        complete = steps_done == cfg.trainer.steps
        if steps_done > saved:  # stopped by a signal between checkpoints: keep what was trained
            self._checkpoint(steps_done, updater, carried)
        self._settle_committed(wait=True, everything=complete)
        if not complete:  # SIGTERM/SIGINT: the run resumes later; samplers keep their weights and wait
            log.info("stopped at step %d with a checkpoint; start the trainer again to resume", steps_done)
            self.server.stop()
            return self._write_summary(steps_done, carried["warmstart"], carried["eval_before"], None, rl_seconds)
        eval_after = self._evaluate("eval_after") if cfg.trainer.eval_after else None
        self._export_hf("model", "trained")  # serve it, or `eval` it
        if self.publisher.latest_version != steps_done or steps_done == self.resumed_step:
            self._publish(steps_done, final=True)  # a resumed, already complete run: tell samplers to stop
        self._await_samplers(steps_done)
        self.server.stop()
        if cfg.weights.verify_prompts:
            problems = self.task.heldout(cfg.weights.verify_prompts)
            self.final_weights = {"version": self.publisher.latest_version,
                                  "sha256": digest(self.model.to_named_numpy(self.params)),
                                  "greedy": greedy_probe(self.engine, self.params, self.tokenizer, problems,
                                                         cfg.eval.batch_size)}
        return self._write_summary(steps_done, carried["warmstart"], carried["eval_before"], eval_after, rl_seconds)

    def _note_positions(self, picked: list[tuple[BufferEntry, GroupData]]) -> None:
        """Data position (per sampler) and buffer position reached by the trained groups, for the checkpoint. Groups
        are picked in stream order, so the last one holds the buffer position."""
        for _, group in picked:
            if group.data_position is not None:
                self.data_position[group.sampler_id] = max(self.data_position.get(group.sampler_id, -1),
                                                           group.data_position)
        self.buffer_position = picked[-1][0].entry_id

    def _track_agreement(self, m: dict) -> None:
        """Run-long sampler-trainer logprob agreement over tokens generated at version lag 0."""
        if m["fresh_tokens"]:
            a = self.agreement
            a["tokens"] += m["fresh_tokens"]
            a["abs_sum"] += m["logprob_diff_mean"] * m["fresh_tokens"]
            a["max_abs"] = max(a["max_abs"], m["logprob_diff_max"])

    def _publish_and_report(self, step, params, groups, staleness, stats, m, phases, tokens_per_second,
                            groups_per_second) -> None:
        final = step == self.cfg.trainer.steps
        if step % self.cfg.trainer.publish_every == 0 or final:
            self._publish(step, params, final=final)
        self._report_step(step, groups, staleness, stats, m, phases, tokens_per_second, groups_per_second)

    def _finish_background(self) -> None:
        """Wait for the last step's publication and report; re-raise what failed there."""
        if self._after_step is not None:
            future, self._after_step = self._after_step, None
            future.result()

    def _report_step(self, step, groups, staleness, stats, m, phases, tokens_per_second, groups_per_second) -> None:
        """One progress line, TensorBoard scalars and a metrics.jsonl row for an RL step."""
        accuracy = float(np.mean([c.reward_components.get("answer_correct", 0.0)
                                  for g in groups for c in g.completions]))
        held = self._held()
        try:
            counters = self._counters = self.buffer.counters()
        except BufferUnavailable:  # Redis is away: report the last known counts rather than fail the step
            counters = self._counters or {"depth": 0, "dropped_stale": 0, "dropped_filtered": 0}
        row = {**stats, **m, "accuracy": accuracy, "staleness_mean": float(staleness.mean()),
               "staleness_max": int(staleness.max()),
               # waiting to be trained; those trained but held for a checkpoint are counted apart
               "buffer_depth": max(0, counters["depth"] - held), "buffer_held": held,
               "groups_dropped_stale": counters["dropped_stale"],
               "groups_dropped_filtered": counters["dropped_filtered"], **phases,
               "wait_seconds": phases["collect_seconds"], "tokens_per_second": tokens_per_second,
               "groups_per_second": groups_per_second, "step_seconds": sum(phases.values()),
               "compute_share": phases["compute_seconds"] / max(sum(phases.values()), 1e-9),
               "zero_variance_groups": int(sum(np.ptp(g.rewards) == 0 for g in groups)),
               "weight_version": self.publisher.latest_version or 0}
        self.metrics.scalars(step, row, prefix="train/")
        self._export(step, row, counters)
        self.metrics.histogram(step, "train/staleness", staleness)
        lags = self._sampler_lags()
        if lags:
            self.metrics.scalars(step, lags, prefix="sampler_weight_lag/", jsonl=False)
        lp_diff = f"{m['logprob_diff_max']:.1e}" if "logprob_diff_max" in m else "-"
        log.info("step %d/%d reward %.3f acc %.3f staleness %.1f/%d buffer %d version %d loss %.4f clip %.3f "
                 "lp_diff(lag0) %s wait %.2fs", step, self.cfg.trainer.steps, stats["reward_mean"], accuracy,
                 row["staleness_mean"], row["staleness_max"], row["buffer_depth"], row["weight_version"], m["loss"],
                 m["clip_fraction"], lp_diff, phases["collect_seconds"])

    def _export(self, step: int, row: dict, counters: dict) -> None:
        """Update the Prometheus series after a step."""
        self.gauges["trainer_step"].set(step)
        for name in ("weight_version", "buffer_depth", "reward_mean", "accuracy", "staleness_mean", "step_seconds",
                     "wait_seconds", "tokens_per_second", "groups_per_second", "compute_share"):
            self.gauges[name].set(row[name])
        for outcome, value in counters.items():
            self.groups_gauge.labels(outcome).set(value)
        for sampler, lag in self._sampler_lags().items():
            self.lag_gauge.labels(sampler).set(lag)

    def _sampler_lags(self) -> dict[str, int]:
        """Per sampler: newest published version minus the version it reports installed."""
        latest = self.publisher.latest_version or 0
        return {sampler: latest - versions[-1] for sampler, versions in dict(self.publisher.installed).items()
                if versions}

    def _await_samplers(self, final_version: int) -> None:
        deadline = time.time() + self.cfg.trainer.final_wait_s
        while time.time() < deadline and not self.stop_event.is_set():
            at = self.publisher.samplers_at(final_version)
            if at and all(at.values()):
                log.info("every sampler (%d) installed the final version %d", len(at), final_version)
                return
            time.sleep(0.2)
        log.warning("samplers not at final version %d after %.0fs: %s", final_version, self.cfg.trainer.final_wait_s,
                    self.publisher.samplers_at(final_version))

    def _export_hf(self, name: str, what: str) -> None:
        """The current policy as a Hugging Face directory RUN_DIR/name, next to the tokenizer files."""
        source = resolve_model_dir(self.cfg.model.path) if self.cfg.model.kind == "hf" else None
        if source is None:
            self.tokenizer.save(self.run_dir / name)  # the tiny model's own tokenizer (an hf source brings its own)
        export_hf(self.run_dir / name, self.model.arch, self.model.to_named_numpy(self.params), tokenizer_dir=source,
                  dtype=self.cfg.model.dtype, eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id)
        log.info("exported the %s model to %s", what, self.run_dir / name)

    def _write_summary(self, steps, warm, eval_before, eval_after, rl_seconds) -> dict:
        counters = self._redis("reading the buffer counters", self.buffer.counters)
        summary = {
            "run": self.cfg.run.name,
            "steps": steps,
            "stopped_early": steps < self.cfg.trainer.steps,
            "trainer_epoch": self.epoch,
            "resumed_from": self.resumed_from,
            "checkpoints_saved": self.checkpointed,
            "groups_ingested": counters["ingested"],
            "groups_trained": counters["trained"],
            "groups_dropped_stale": counters["dropped_stale"],
            "groups_dropped_invalid": counters["dropped_invalid"],
            "groups_dropped_filtered": counters["dropped_filtered"],
            "groups_dropped_duplicate": counters["dropped_duplicate"],
            "groups_left_in_buffer": counters["depth"],
            "groups_by_sampler": self._redis("reading the buffer counters", self.buffer.ingested_by_sampler),
            "ingest_rejected_invalid": counters["refused_invalid"],
            "ingest_refused_duplicate": counters["refused_duplicate"],
            "ingest_backpressure_replies": counters["refused_full"],
            "weight_versions_published": len(self.publisher.published),
            "weight_versions": self.publisher.published,
            "weight_transport": self.cfg.weights.transport,
            "weight_publish_seconds_mean": (round(float(np.mean(self.publisher.publish_seconds)), 4)
                                            if self.publisher.publish_seconds else None),
            "trainer_mesh": dict(self.mesh.shape),
            "final_weights": getattr(self, "final_weights", None),
            "sampler_weight_versions": self.publisher.installed,
            "algo": self.cfg.algo.model_dump(mode="json"),
            "logprob_agreement_lag0": {
                "tokens": int(self.agreement["tokens"]),
                "mean_abs": self.agreement["abs_sum"] / self.agreement["tokens"] if self.agreement["tokens"] else None,
                "max_abs": self.agreement["max_abs"] if self.agreement["tokens"] else None},
            "warmstart": warm,
            "eval_before": eval_before,
            "eval_after": eval_after,
            "rl_seconds": round(rl_seconds, 2),
            "wall_seconds": round(time.time() - self.started, 2),
        }
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2))
        log.info("summary written to %s", path)
        return summary


def run_trainer(cfg: RunConfig, run_dir: pathlib.Path) -> dict:
    trainer = Trainer(cfg, run_dir)
    stop_on_signals(trainer.stop_event, "step")
    return trainer.run()
