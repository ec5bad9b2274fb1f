"""The trainer process: ingest server, off-policy GRPO steps, weight publication, summary.

Versions: the weights published after RL step s carry version s (version 0
is the model when RL starts). While computing step s the trainer holds
version s-1, so a group generated with version v has staleness
(s - 1) - v; groups with staleness above `trainer.max_staleness` are
dropped, counted and logged, never trained on.
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

from common.buffer import BufferEntry, BufferUnavailable, RedisStreamBuffer
from common.config import RunConfig
from common.evaluation import evaluate
from common.generation import Engine
from common.hf_checkpoint import export_hf, resolve_model_dir
from common.metrics import MetricsWriter
from common.prometheus import ServiceMetrics
from common.redis_util import connect
from common.runtime import build_policy, build_task_and_tokenizer, stop_on_signals
from common.evaluation import greedy_probe
from common.sharding import make_mesh, place
from common.weight_checkpoint import CheckpointWeightStore
from common.weights import digest
from common.wire import GroupData, GroupLimits, decode_group
from trainer_service.batching import build_batch
from trainer_service.ingest import IngestServicer
from trainer_service.publisher import WeightPublisher
from trainer_service.server import TrainerServer
from trainer_service.rl_update import PolicyUpdater
from trainer_service.selection import partition_groups
from trainer_service.warmstart import warm_start

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

    # -- set-up -----------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.cfg
        if cfg.redis.url is None:
            raise ValueError("redis.url is null: give the buffer's Redis URL (e.g. redis.url=redis://host:6379/0), "
                             "or run `grpo-stream up`, which starts an embedded Redis")
        client = connect(cfg.redis.url, cfg.redis.connect_timeout_s)
        self.buffer = RedisStreamBuffer(client, cfg.run.name)
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
        limits = GroupLimits(gen.num_generations, gen.max_prompt_tokens, gen.max_new_tokens, self.tokenizer.vocab_size)
        self.ingest = IngestServicer(self.buffer, limits, cfg.buffer.max_groups, cfg.buffer.retry_after_ms)
        w = cfg.weights
        if w.transport == "checkpoint" and not w.checkpoint_dir:
            raise ValueError("weights.transport=checkpoint needs weights.checkpoint_dir: a directory every sampler "
                             "can read (shared disk or gs://); `up` uses RUN_DIR/weights")
        if w.transport == "local" and self.hub is None:
            raise ValueError("weights.transport=local runs the samplers inside the trainer's process: start the run "
                             "with `grpo-stream up` (or `grpo-stream colocated`), or choose grpc / checkpoint")
        store = CheckpointWeightStore(w.checkpoint_dir, w.keep_versions) if w.transport == "checkpoint" else None
        self.publisher = WeightPublisher(w.transport, w.chunk_bytes, w.max_serve_mb_s, store, self.hub,
                                         w.wire_dtype)
        tcp = w.transport == "grpc" and w.data_plane == "tcp"
        self.server = TrainerServer(self.ingest, self.publisher, cfg.trainer.host, cfg.trainer.port,
                                    data_port=w.data_port if tcp else None)
        port = self.server.start()
        log.info("gRPC server (ingest, weights, health) on %s:%d%s", cfg.trainer.host, port,
                 f"; weights data plane on port {self.server.data.port}" if tcp else "")
        self.metrics = MetricsWriter(self.run_dir, "trainer")
        self.prom = ServiceMetrics("trainer")
        self.gauges = {name: self.prom.gauge(name, doc) for name, doc in (
            ("trainer_step", "RL steps completed"), ("weight_version", "latest published weight version"),
            ("buffer_depth", "groups in the rollout buffer"), ("reward_mean", "mean reward of the last batch"),
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
    def _collect(self, step: int) -> list[tuple[BufferEntry, GroupData]] | None:
        """groups_per_step fresh-enough groups, oldest first; drops stale ones. None when stopping."""
        need, holding = self.cfg.trainer.groups_per_step, self.cfg.trainer.max_staleness
        current = step - 1
        last_note = time.time()
        while True:
            fresh, stale, flat = partition_groups(self.pending, current, holding, self.cfg.algo.dynamic_sampling)
            if stale or flat:
                self.buffer.settle(dropped_stale=[e.entry_id for e, _ in stale],
                                   dropped_filtered=[e.entry_id for e, _ in flat])
            if stale:
                log.info("dropped %d stale groups (versions %s, trainer at %d, max_staleness %d)", len(stale),
                         sorted({g.policy_version for _, g in stale}), current, holding)
            self.pending = fresh
            if len(self.pending) >= need:
                batch, self.pending = self.pending[:need], self.pending[need:]
                return batch
            if self.stop_event.is_set():
                return None
            try:
                entries = self.buffer.read(max_count=need * 2, block_ms=500)
            except BufferUnavailable as exc:
                log.error("buffer read failed (%s); retrying", exc)
                time.sleep(1.0)
                continue
            undecodable = []
            for entry in entries:
                try:
                    self.pending.append((entry, decode_group(entry.payload)))
                except Exception as exc:  # noqa: BLE001 - a corrupt entry must not stop training
                    log.error("undecodable buffer entry %s dropped: %s", entry.entry_id, exc)
                    undecodable.append(entry.entry_id)
            if undecodable:
                self.buffer.settle(dropped_invalid=undecodable)
            if time.time() - last_note > 10:
                log.info("step %d waiting for rollouts: %d/%d groups, buffer depth %d", step, len(self.pending), need,
                         self.buffer.depth())
                last_note = time.time()

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
            for part in ("metrics", "prom"):
                closer = getattr(getattr(self, part, None), "close" if part == "metrics" else "stop", None)
                if closer is not None:
                    closer()
        return summary

    def _run(self) -> dict:
        cfg = self.cfg
        warm = None
        if cfg.warmstart.steps:
            self.params, warm = warm_start(self.model, self.params, self.task, self.tokenizer, cfg, self.metrics,
                                          self.stop_event)
        eval_before = self._evaluate("eval_before") if cfg.trainer.eval_before else None
        self._publish(0)
        log.info("published weight version 0; RL starts")
        updater = PolicyUpdater(self.model, self.params, cfg.algo, cfg.trainer.learning_rate,
                                cfg.trainer.max_grad_norm, cfg.generation.temperature, self.tokenizer.pad_id,
                                self.mesh)
        algo = cfg.algo
        rl_start, steps_done, tokens_total, groups_total = time.time(), 0, 0, 0
        last_end = time.time()
        for step in range(1, cfg.trainer.steps + 1):
            # Phases of a step, from the end of the previous one: collect (wait for,
            # read and decode groups), batch, compute (the jitted update; its metrics
            # are host values, so it has finished), then settle + publish + report.
            t0 = last_end
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
            self.buffer.settle(trained=[e.entry_id for e, _ in picked])
            steps_done = step
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
        if steps_done < cfg.trainer.steps:  # stopped early: tell samplers this is the last version
            self._publish(steps_done, final=True)
        eval_after = self._evaluate("eval_after") if cfg.trainer.eval_after else None
        # the trained policy as a Hugging Face directory (next to the tokenizer files): serve it, or `eval` it
        source = resolve_model_dir(cfg.model.path) if cfg.model.kind == "hf" else None
        export_hf(self.run_dir / "model", self.model.arch, self.model.to_named_numpy(self.params),
                  tokenizer_dir=source, dtype=cfg.model.dtype, eos_ids=self.tokenizer.eos_ids,
                  pad_id=self.tokenizer.pad_id)
        log.info("exported the trained model to %s", self.run_dir / "model")
        self._await_samplers(steps_done)
        self.server.stop()
        if cfg.weights.verify_prompts:
            problems = self.task.heldout(cfg.weights.verify_prompts)
            self.final_weights = {"version": self.publisher.latest_version,
                                  "sha256": digest(self.model.to_named_numpy(self.params)),
                                  "greedy": greedy_probe(self.engine, self.params, self.tokenizer, problems,
                                                         cfg.eval.batch_size)}
        return self._write_summary(steps_done, warm, eval_before, eval_after, rl_seconds)

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
        counters = self.buffer.counters()
        row = {**stats, **m, "accuracy": accuracy, "staleness_mean": float(staleness.mean()),
               "staleness_max": int(staleness.max()), "buffer_depth": counters["depth"],
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

    def _write_summary(self, steps, warm, eval_before, eval_after, rl_seconds) -> dict:
        counters = self.buffer.counters()
        summary = {
            "run": self.cfg.run.name,
            "steps": steps,
            "groups_ingested": counters["ingested"],
            "groups_trained": counters["trained"],
            "groups_dropped_stale": counters["dropped_stale"],
            "groups_dropped_invalid": counters["dropped_invalid"],
            "groups_dropped_filtered": counters["dropped_filtered"],
            "groups_left_in_buffer": counters["depth"],
            "groups_by_sampler": self.buffer.ingested_by_sampler(),
            "ingest_rejected_invalid": self.ingest.stats["invalid"],
            "ingest_backpressure_replies": self.ingest.stats["full"],
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
