"""The trainer process: ingest server, off-policy GRPO steps, weight publication, summary.

Versions: the weights published after RL step s carry version s (version 0
is the model when RL starts). While computing step s the trainer holds
version s-1, so a group generated with version v has staleness
(s - 1) - v; groups with staleness above `trainer.max_staleness` are
dropped, counted and logged, never trained on.

This module sets up process 0 (or the only process) of the trainer: its services (buffer lease, durability, ingest,
weight publication, status), the core and the plan source, then writes summary.json. What runs on the devices:
core.py (the same in every process); what happens when: plans.py and plan_sources.py; where a step's groups come
from: learning/collector.py; exactly-once across crashes: checkpoints/durability.py; what a step reports:
reports/step_report.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import threading
import time
from typing import Any

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.rollouts.buffer import RUN_FILE
from grpo_stream.common.rollouts.redis_server import redacted
from grpo_stream.common.rollouts.registry import open_leased_buffer
from grpo_stream.common.rollouts.wire import group_limits
from grpo_stream.common.rpc.grpc_util import ServerSecurity
from grpo_stream.common.runtime.heartbeat import Heartbeat
from grpo_stream.common.runtime.process import stop_on_signals
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.common.weights.registry import weight_sink
from grpo_stream.common.weights.snapshot import new_epoch
from grpo_stream.common.weights.transport import SinkContext
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.learning.batching import no_signal_test
from grpo_stream.trainer_service.learning.collector import GroupCollector
from grpo_stream.trainer_service.core import TrainerCore
from grpo_stream.trainer_service.model_parts import ModelParts, build_model_parts
from grpo_stream.trainer_service.checkpoints.durability import Durability
from grpo_stream.trainer_service.ingest.server import ingest_servicers
from grpo_stream.common.runtime.files import write_atomic
from grpo_stream.trainer_service.reports.metrics import MetricsWriter, final_figures, open_trackers
from grpo_stream.trainer_service.multihost import TrainerGroup, ignore_signals, start_group
from grpo_stream.trainer_service.plan_sources import LeaderSource, drive
from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue
from grpo_stream.trainer_service.ingest.prompt_service import StatusWriter
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.learning.rl_update import donates_updates
from grpo_stream.trainer_service.reports.run_outputs import write_summary
from grpo_stream.trainer_service.server import TrainerServer
from grpo_stream.trainer_service.reports.step_report import StepReporter

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LeaderServices:
    """Process 0's device-free parts, which the plan source and the summary use."""
    epoch: str
    stop_event: threading.Event
    pad_id: int = 0
    buffer: Any = None
    lease: Any = None
    durability: Durability | None = None
    checkpoints: TrainerCheckpoints | None = None
    publisher: WeightPublisher | None = None
    server: TrainerServer | None = None
    status: StatusWriter | None = None
    collector: GroupCollector | None = None
    metrics: MetricsWriter | None = None
    reporter: StepReporter | None = None


class Trainer:
    """Trainer process 0, or the only one: its services around a TrainerCore, driven by a LeaderSource."""

    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, devices=None, hub=None, group: TrainerGroup | None = None):
        """`devices`: the trainer mesh's devices (default: all); `hub`: in-process weight hub (transport local);
        `group`: the other processes of a multi-process trainer (trainer.processes > 1), which follow this one."""
        self.cfg, self.run_dir, self.devices, self.hub, self.group = cfg, run_dir, devices, hub, group
        self.stop_event = threading.Event()
        self.started = time.time()
        self.s = LeaderServices(epoch=new_epoch(), stop_event=self.stop_event)  # epoch: also the publisher's
        self.core: TrainerCore | None = None
        self.source: LeaderSource | None = None

    # what tests and benchmarks read after a run
    model = property(lambda self: self.core.model)
    params = property(lambda self: self.core.params)
    step_times = property(lambda self: self.source.step_times)
    resumed_from = property(lambda self: self.core.resumed_from)

    def run(self) -> dict:
        failed = True
        try:
            self._setup()
            drive(self.source, self.core, self.run_dir, "trainer-0")
            self.s.server.stop()  # a stopped run's samplers keep their weights and wait for the resumed one
            summary = self._summary()
            self.s.metrics.summary(final_figures(summary, self.run_dir, self.started))
            failed = False
            return summary
        except BaseException:
            # a failed run must still release its gRPC threads, or the process never exits
            if self.s.server is not None:
                self.s.server.stop(grace_s=0)
            raise
        finally:
            if self.source is not None and failed:  # a plan prefetch still waiting for groups ends now
                self.source.close()
            if self.core is not None:
                self.core.close(failed)
            self._close_parts(failed)

    def _close_parts(self, failed: bool) -> None:
        """Close each part even after another failed to (a reporter whose close raises must not keep the run's lease
        held); the first error is raised after all were tried."""
        error = None
        for part, close in (("status", lambda p: p.stop()), ("checkpoints", lambda p: p.close()),
                            ("reporter", lambda p: p.close(failed)), ("lease", lambda p: p.release())):
            if getattr(self.s, part) is None:
                continue
            try:
                close(getattr(self.s, part))
            except Exception as exc:  # noqa: BLE001 - the next parts must still close
                log.exception("closing the trainer's %s failed", part)
                error = error or exc
        if error is not None and not failed:
            raise error

    def _setup(self) -> None:
        cfg, s = self.cfg, self.s
        security = ServerSecurity.from_config(cfg)  # a missing token table or certificate fails before any wait
        s.buffer, s.lease = open_leased_buffer(cfg, self.stop_event)  # one trainer per run, before any write
        s.checkpoints = TrainerCheckpoints(cfg.checkpoint.dir or str((self.run_dir / "checkpoints").resolve()),
                                           cfg.checkpoint.keep, cfg.checkpoint.verify)
        s.checkpoints.progress = Heartbeat(self.run_dir, "trainer-0")  # a restore's hashing is progress
        s.durability = Durability(cfg, s.buffer, s.checkpoints, s.epoch, self.stop_event)
        # where `grpo-stream audit RUN_DIR` finds the trail (the password stays out of the file)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.run_dir / RUN_FILE, json.dumps({"run": cfg.run.name, "redis_url": redacted(cfg.redis.url)}))
        parts = build_model_parts(cfg, self.devices)
        parts.tokenizer.save(self.run_dir / "model")
        s.pad_id = parts.tokenizer.pad_id
        self._serve(parts, security)
        s.metrics = open_trackers(cfg, self.run_dir)  # W&B too when tracking.wandb.enabled: process 0 only
        s.reporter = StepReporter(cfg, s.metrics, s.buffer, s.publisher, s.durability.held, parts.tokenizer)
        self.source = LeaderSource(cfg, self.run_dir, s, self.group)
        s.collector = GroupCollector(s.buffer, cfg.trainer.groups_per_step, cfg.trainer.max_staleness,
                                     no_signal_test(cfg.algo, cfg.generation.max_new_tokens), self.stop_event,
                                     s.durability.held,
                                     limits=group_limits(cfg.generation, parts.tokenizer.vocab_size),
                                     waiting=self.source.collector_waiting,
                                     samplers=lambda: sampler_contact(s.publisher.samplers.status(None)))
        # several processes run the warm start in lockstep: a signal takes effect after it, at a step
        self.core = TrainerCore(cfg, self.run_dir, parts, s.publisher, s.durability, hooks=self.source,
                                donate=donates_updates(transport_spec(cfg.weights.transport).in_process),
                                metrics=s.metrics, warm_stop=self.stop_event if self.group is None else None)
        self.source.pack = self.core.pack  # plans come packed, on the prefetch thread with trainer.prefetch_plans

    def _serve(self, parts: ModelParts, security: ServerSecurity) -> None:
        """The gRPC server: ingest and prompts (unless ingest.standalone), weights, status."""
        cfg, s = self.cfg, self.s
        ingest, prompts = (None, None) if cfg.ingest.standalone else ingest_servicers(
            cfg, s.buffer, parts.task, parts.tokenizer, security)
        w, transport = cfg.weights, transport_spec(cfg.weights.transport)
        s.publisher = WeightPublisher(weight_sink(w.transport, SinkContext(w, self.hub)), w.transport, w.chunk_bytes,
                                      w.wire_dtype, epoch=s.epoch)
        tcp = transport.trainer_serves and w.data_plane == "tcp"
        s.server = TrainerServer(ingest, s.publisher, cfg.trainer.host, cfg.trainer.port,
                                 data_port=w.data_port if tcp else None, security=security, prompts=prompts,
                                 max_serve_mb_s=w.max_serve_mb_s)
        port = s.server.start()
        if self.group is not None:  # the manifest lists every process's slices, once all of them serve a version
            self.group.serve_versions(s.publisher, port, s.server.data.port if s.server.data else 0)
        s.status = StatusWriter(PromptQueue(s.buffer.client, cfg.run.name), s.publisher, cfg.trainer.steps).start()
        log.info("gRPC server (%sweights, health, reflection; auth %s%s) on %s:%d%s",
                 "" if cfg.ingest.standalone else "ingest, prompts, ", cfg.auth.mode, ", TLS" if cfg.tls.enabled else "",
                 cfg.trainer.host, port, f"; weights data plane on port {s.server.data.port}" if tcp else "")

    def _summary(self) -> dict:
        cfg, s, core, source = self.cfg, self.s, self.core, self.source
        counters = {**s.durability.available("reading the buffer counters", s.buffer.counters),
                    "trained_mixed_versions": source.mixed_version_groups}
        by_sampler = s.durability.available("reading the buffer counters", s.buffer.ingested_by_sampler)
        return write_summary(self.run_dir / "summary.json", cfg, steps=source.steps_done, counters=counters,
                             by_sampler=by_sampler, publisher=s.publisher, durability=s.durability,
                             agreement=source.agreement, mesh_shape=dict(core.parts.mesh.shape),
                             final_weights=core.final_weights, carried=core.carried_now(), eval_after=source.eval_after,
                             rl_seconds=source.rl_seconds, started=self.started, resumed_from=core.resumed_from,
                             trained_here=(source.steps_done - s.durability.resumed_step) * cfg.trainer.groups_per_step,
                             trainer_state=core.state_report(), tokens=source.tokens)


def sampler_contact(status: list[dict], now: float | None = None) -> str:
    """A line on the samplers' last reports (SamplerRegistry.status) for a step that waits for groups: none, or how
    long ago the latest came (a running sampler asks for the weights every sampler.weight_poll_s)."""
    if not status:
        return "none has reported to this trainer since it started"
    ages = sorted((now or time.time()) - row["last_seen_unix"] for row in status)
    return f"{len(status)} known, the latest report {ages[0]:.0f}s ago, the oldest {ages[-1]:.0f}s ago"


def run_trainer(cfg: RunConfig, run_dir: pathlib.Path) -> dict | None:
    """Run this trainer process; the summary (None on trainer processes other than 0 of a multi-process trainer)."""
    group = start_group(cfg)
    if group is not None and not group.leader:
        from grpo_stream.trainer_service.follower import run_follower  # noqa: PLC0415

        # a signal stops the job through process 0, which tells the others: alone, one would leave the rest waiting
        ignore_signals()
        run_follower(cfg, run_dir, group)
        return None
    trainer = Trainer(cfg, run_dir, group=group)
    stop_on_signals(trainer.stop_event, "step")
    if group is None:
        return trainer.run()
    from grpo_stream.trainer_service.follower import stop_now  # noqa: PLC0415

    try:
        return trainer.run()
    except BaseException as exc:
        # process 0 failing while the others wait for its next message: JAX's at-exit shutdown would hold this
        # process at a barrier for 5 minutes (then abort), and the supervisor would see a live job meanwhile. It
        # exits 3 for a permanent failure (recorded), else 1 (restarted): config errors were met before run()
        stop_now(0, exc, run_dir)
        raise  # an interrupt (Ctrl-C, SystemExit), which stop_now leaves to the CLI
