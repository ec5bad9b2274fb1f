"""Single-controller mode: the trainer and every sampler in one JAX process (weights.transport=local).

This is the MaxText/Tunix demo layout: one process owns all devices and
splits them, the trainer taking the first `weights.trainer_devices_fraction`
and the samplers the last `weights.sampler_devices_fraction` (each sampler
`sampler.mesh.tp` of them), or all sharing one mesh when both are 1.0. The
samplers run as threads with the same loop as sampler processes (rollouts
still go through the trainer's ingest and the Redis buffer); published
weights move by jax.device_put from the trainer's arrays. Under Pathways on
TPU the same code spans slices.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import types

import jax

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.model.sharding import split_devices
from grpo_stream.common.weights.local_transport import LocalWeightHub
from grpo_stream.common.registry.transports import TRANSPORTS, transport_spec
from grpo_stream.sampler_service.loop import Sampler
from grpo_stream.trainer_service.loop import Trainer
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.common.runtime.process import stop_on_signals

log = logging.getLogger(__name__)


def sampler_device_groups(devices: list, replicas: int, tp: int, shared: bool) -> list[list]:
    """Each sampler's `tp` devices from the sampler share; with a shared mesh they may wrap around."""
    if not shared and replicas * tp > len(devices):
        raise ValueError(f"sampler.replicas x sampler.mesh.tp = {replicas} x {tp} devices, but the sampler share "
                         f"(weights.sampler_devices_fraction) holds {len(devices)}; lower them or raise the share")
    if tp > len(devices):
        raise ValueError(f"sampler.mesh.tp={tp} exceeds the {len(devices)} devices of the sampler share")
    return [[devices[(i * tp + j) % len(devices)] for j in range(tp)] for i in range(replicas)]


def run_colocated(cfg: RunConfig, run_dir: pathlib.Path) -> dict:
    if not transport_spec(cfg.weights.transport).in_process:
        raise ValueError(f"weights.transport={cfg.weights.transport}: `colocated` runs a transport within one process "
                         f"(one of {[n for n, t in TRANSPORTS.items() if t.in_process]}); use `up` (or trainer + "
                         "sampler processes) for the others")
    w = cfg.weights
    shared = w.trainer_devices_fraction == 1.0 and w.sampler_devices_fraction == 1.0
    train_devices, sample_devices = split_devices(jax.devices(), w.trainer_devices_fraction,
                                                  w.sampler_devices_fraction)
    groups = sampler_device_groups(sample_devices, cfg.sampler.replicas, cfg.sampler.mesh.tp, shared)
    log.info("single controller: trainer on %d devices, %d samplers on %s", len(train_devices), len(groups),
             [[d.id for d in g] for g in groups])
    hub = LocalWeightHub()
    trainer = Trainer(cfg, run_dir, devices=train_devices, hub=hub)
    samplers = [Sampler(cfg, i, devices=g, hub=hub, run_dir=run_dir) for i, g in enumerate(groups)]
    failures: list[BaseException] = []

    def _sample(sampler: Sampler) -> None:
        try:
            sampler.run()
        except BaseException as exc:  # noqa: BLE001 - reported, and it stops the run
            log.exception("%s failed", sampler.sampler_id)
            failures.append(exc)
            trainer.stop_event.set()

    def _stop_all() -> None:
        trainer.stop_event.set()
        for sampler in samplers:
            sampler.stop_event.set()

    stop_on_signals(types.SimpleNamespace(set=_stop_all), "step and batches")  # a stop held since start-up too
    threads = [threading.Thread(target=_sample, args=(s,), name=s.sampler_id, daemon=True) for s in samplers]
    for thread in threads:
        thread.start()
    try:
        summary = trainer.run()
    finally:
        for sampler in samplers:
            if trainer.stop_event.is_set() or failures:
                sampler.stop_event.set()
        for thread in threads:
            thread.join(timeout=60)
    if failures:
        if isinstance(failures[0], PermanentError):  # as it is: the CLI exits 3 and up does not restart it
            raise failures[0]
        raise RuntimeError(f"a sampler failed: {failures[0]}") from failures[0]
    return summary
