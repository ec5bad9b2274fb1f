"""Trainer processes 1..N-1 of a multi-process trainer (trainer.processes > 1; multihost.py says how it works).

A follower runs the same TrainerCore as process 0 on the plans process 0 sends (plan_sources.FollowerSource), so it
launches the same programs and collectives in the same order by construction. Around the core it has only its own
device-free parts: a server for its slices of each weight version and its shards of each checkpoint (Orbax writes
every process's shards into the one checkpoint). It has no buffer, ingest or status. On any error it ends at once
(`stop_now`) so that the job stops instead of waiting for it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sys

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.rpc.grpc_util import ServerSecurity
from grpo_stream.common.runtime.errors import EXIT_FAILURE, EXIT_PERMANENT, PermanentError, record_permanent
from grpo_stream.common.runtime.heartbeat import Heartbeat
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.common.weights.registry import weight_sink
from grpo_stream.common.weights.transport import SinkContext
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.control_messages import ControlMessageError
from grpo_stream.trainer_service.core import TrainerCore
from grpo_stream.trainer_service.model_parts import build_model_parts
from grpo_stream.trainer_service.checkpoints.durability import Resumed, updater_state
from grpo_stream.trainer_service.reports.metrics import MetricsWriter
from grpo_stream.trainer_service.multihost import TrainerGroup, advertised_host, is_loopback
from grpo_stream.trainer_service.plan_sources import FollowerSource, drive
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater, donates_updates
from grpo_stream.trainer_service.server import TrainerServer

log = logging.getLogger(__name__)


class ShardKeeper:
    """A follower's checkpoints: its shards of the steps process 0 saves and restores; process 0 keeps the records
    and acknowledges the groups (checkpoints/durability.py)."""

    def __init__(self, checkpoints: TrainerCheckpoints, index: int):
        self.checkpoints, self.index = checkpoints, index

    def restore(self, step: int, updater: PolicyUpdater) -> Resumed | None:
        # the step to restore is process 0's choice, whatever this process lists (checkpoints/store.py: choose_step)
        self.checkpoints.agree_step(step)
        restored = self.checkpoints.restore_agreed(updater_state(updater))  # that step, never another
        if restored is None:
            return None
        if "params" not in restored.state:  # the schema refuses model.lora with several processes (its base is
            raise ControlMessageError(      # saved by process 0 alone); a checkpoint of such a run cannot go on here
                f"trainer process {self.index}: the checkpoint of step {restored.step} holds LoRA adapters, which a "
                "trainer of several processes does not restore; resume it with trainer.processes=1")
        return Resumed(restored.step, restored.state, restored.record)

    def begin_new_run(self) -> None:
        pass

    def save(self, step: int, updater: PolicyUpdater, carried: dict) -> None:
        self.checkpoints.save(step, updater_state(updater), {"process": self.index})

    def committed(self, wait: bool = False, everything: bool = False) -> None:
        self.checkpoints.committed(wait=wait)


def follower_server(cfg: RunConfig, index: int, publisher: WeightPublisher) -> TrainerServer:
    """The server of this process's weight slices: process 0's ports on a host of its own; processes sharing a
    machine (advertised on loopback, as `up` runs them) take trainer.port + index and weights.data_port + index."""
    w = cfg.weights
    offset = index if is_loopback(advertised_host()) else 0
    return TrainerServer(None, publisher, cfg.trainer.host, cfg.trainer.port + offset if cfg.trainer.port else 0,
                         security=ServerSecurity.from_config(cfg), max_serve_mb_s=w.max_serve_mb_s,
                         data_port=(w.data_port + offset if w.data_port else 0) if w.data_plane == "tcp" else None)


def run_follower(cfg: RunConfig, run_dir: pathlib.Path, group: TrainerGroup) -> None:
    index, w = group.index, cfg.weights
    checkpoints = server = core = None
    try:  # checkpoint.dir too: unusable on this host only (a missing mount), it must stop the job, not hang it
        checkpoints = TrainerCheckpoints(cfg.checkpoint.dir or str((run_dir / "checkpoints").resolve()),
                                         cfg.checkpoint.keep, cfg.checkpoint.verify)
        checkpoints.progress = Heartbeat(run_dir, f"trainer-{index}")  # a restore's hashing is progress
        parts = build_model_parts(cfg)
        publisher = WeightPublisher(weight_sink(w.transport, SinkContext(w)), w.transport, w.chunk_bytes, w.wire_dtype)
        server = follower_server(cfg, index, publisher)
        port = server.start()
        group.serve_versions(publisher, port, server.data.port if server.data else 0)
        log.info("trainer process %d serves its weight slices on port %d", index, port)
        core = TrainerCore(cfg, run_dir, parts, publisher, ShardKeeper(checkpoints, index), writes_files=False,
                           donate=donates_updates(transport_spec(w.transport).in_process),
                           metrics=MetricsWriter(run_dir, f"trainer-{index}"))  # its warm start's own curve
        source = FollowerSource(cfg, group)
        source.pack = core.pack  # the batch packed beside the update, with trainer.prefetch_plans
        drive(source, core, run_dir, f"trainer-{index}")
        server.stop()
        log.info("trainer process %d done at step %d", index, source.steps_done)
    except BaseException as exc:
        if server is not None:  # its threads would keep the process alive
            server.stop(grace_s=0)
        stop_now(index, exc, run_dir)
        raise
    finally:
        if core is not None:
            core.close()
        if checkpoints is not None:
            checkpoints.close()


def stop_now(index: int, exc: BaseException, run_dir: pathlib.Path | None = None) -> None:
    """End this process at once after an error that process 0 did not cause (a forged message, a checkpoint it
    cannot read): process 0 waits for it in a collective or a barrier, and JAX's at-exit shutdown would wait for
    process 0 at another barrier for up to 5 minutes, so `up` (or a JobSet) would see a live process and a job that
    hangs. Exiting lets the supervisor stop the job and restart it from its newest checkpoint; a permanent failure
    (a checkpoint of another layout) is recorded and exits 3, so that the supervisor stops the run instead."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return
    log.error("trainer process %d stops: %s: %s", index, type(exc).__name__, exc, exc_info=exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    permanent = isinstance(exc, PermanentError)
    if permanent:
        record_permanent(run_dir, f"trainer-{index}", exc)
    os._exit(EXIT_PERMANENT if permanent else EXIT_FAILURE)
