"""A trainer of several JAX processes (trainer.processes > 1): multi-controller JAX, one process per host.

Every process holds its shards of the parameters and optimizer state and runs every program (the update,
evaluation, checkpoint saves) in the same order; the collectives between them are XLA's (ICI/DCN on a TPU slice,
NCCL on GPUs, Gloo between CPU processes). Process 0 leads: it alone serves the ingest, prompts and status, reads
the buffer and acknowledges groups, and it sends every other process what they cannot decide alone, in order:
each step's batch and whether that step checkpoints and publishes, and the end of the run. The messages travel
through the key-value store of JAX's distributed runtime (the coordination service process 0 runs), not through a
device collective: a batch's shape changes from step to step and would compile a broadcast per shape.

Each process serves its own slices of each published version (common/weights/host_shards.py); process 0's
manifest lists every process's address and switches to a version only once all of them serve it.

If any process dies the others cannot go on (their collectives would wait for it for ever): the whole job stops
and restarts from the newest checkpoint, as a JobSet restarts its pods and `up` restarts its trainer processes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
from typing import Any

import jax
import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.protos import weights_pb2

log = logging.getLogger(__name__)

ADVERTISE_ENV = "GRPO_STREAM_ADVERTISE_HOST"  # the address samplers reach this process at (e.g. the pod IP)
WAIT_MS = 60_000  # one wait on the store; a follower waits for the next message for as long as the leader needs
PUBLISH_WAIT_S = 600.0  # process 0 waits this long for the others to serve a version they publish with it
KEEP_MESSAGES = 4  # messages kept in the store: each one's work meets a collective before the leader sends more


class TrainerGroup:
    """This process's place in a multi-process trainer and the channel from process 0 to the others."""

    def __init__(self, processes: int, index: int, client: Any):
        self.processes, self.index, self._client = processes, index, client
        self._sent = self._received = 0
        self._announced: list[tuple[str, int]] = []  # (epoch, version) whose announcements process 0 read

    @property
    def leader(self) -> bool:
        return self.index == 0

    # -- messages: process 0 -> every other process, in order --------------------------------------------------
    def send(self, kind: str, fields: dict | None = None, arrays: dict[str, np.ndarray] | None = None) -> None:
        """Process 0: send message `kind` with JSON `fields` and numpy `arrays` to every other process."""
        header = json.dumps({"kind": kind, **(fields or {})}).encode()
        body = io.BytesIO()
        np.savez(body, **(arrays or {}))
        self._client.key_value_set_bytes(f"grpo/msg/{self._sent}", len(header).to_bytes(8, "little") + header
                                         + body.getvalue())
        if self._sent >= KEEP_MESSAGES:
            self._client.key_value_delete(f"grpo/msg/{self._sent - KEEP_MESSAGES}")
        self._sent += 1

    def receive(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Another process: the next message from process 0, (fields with "kind", arrays); waits as long as needed
        and raises when process 0 is gone (its coordination service answers no more)."""
        key = f"grpo/msg/{self._received}"
        while True:
            try:
                raw = self._client.blocking_key_value_get_bytes(key, WAIT_MS)
                break
            except Exception as exc:  # noqa: BLE001 - jaxlib raises one error type; a timeout only means "not yet"
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise RuntimeError(f"trainer process {self.index}: lost trainer process 0 ({exc}); the job "
                                       "stops and restarts from its newest checkpoint") from exc
        self._received += 1
        size = int.from_bytes(raw[:8], "little")
        fields = json.loads(raw[8:8 + size])
        with np.load(io.BytesIO(raw[8 + size:]), allow_pickle=False) as npz:  # never unpickles
            arrays = {name: npz[name] for name in npz.files}
        return fields, arrays

    # -- weight publication from every process ------------------------------------------------------------------
    def announce(self, epoch: str, version: int, port: int, data_port: int) -> None:
        """Every process: it serves its slices of `version` of trainer epoch `epoch` at its address."""
        where = {"address": advertised_host(), "port": port, "data_port": data_port}
        self._client.key_value_set(f"grpo/weights/{epoch}/{version}/{self.index}", json.dumps(where))

    def serve_versions(self, publisher: Any, port: int, data_port: int) -> None:
        """Hook `publisher` (a WeightPublisher) so that each version it switches to is announced as served by this
        process at `port`/`data_port`, and on process 0 so that its manifest switches only once every process serves
        the version, listing them all."""
        def switch(manifest: weights_pb2.WeightManifest) -> None:
            self.announce(manifest.trainer_epoch, manifest.version, port, data_port)
            if self.leader:
                self.hosts_of(manifest, PUBLISH_WAIT_S)
        publisher.gather_hosts = switch

    def hosts_of(self, manifest: weights_pb2.WeightManifest, timeout_s: float) -> None:
        """Process 0: wait until every process serves `manifest`'s version, then list them in `manifest.hosts`."""
        manifest.ClearField("hosts")
        for p in range(self.processes):
            key = f"grpo/weights/{manifest.trainer_epoch}/{manifest.version}/{p}"
            try:
                where = json.loads(self._client.blocking_key_value_get(key, int(timeout_s * 1000)))
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(f"trainer process {p} did not serve weight version {manifest.version} within "
                                   f"{timeout_s:.0f}s ({exc})") from exc
            manifest.hosts.add(**where)
        self._announced.append((manifest.trainer_epoch, manifest.version))
        if len(self._announced) > 2:  # older announcements are never read again
            epoch, version = self._announced.pop(0)
            for p in range(self.processes):
                self._client.key_value_delete(f"grpo/weights/{epoch}/{version}/{p}")


def ignore_signals() -> None:
    """Trainer processes other than 0 ignore SIGTERM/SIGINT: process 0 stops the job (a checkpoint by all of them),
    and they exit when it tells them or when it is gone."""
    import signal  # noqa: PLC0415

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def advertised_host() -> str:
    """Where samplers reach this process: GRPO_STREAM_ADVERTISE_HOST (set it to the pod IP on Kubernetes), else
    the address this host's name resolves to."""
    return os.environ.get(ADVERTISE_ENV) or socket.gethostbyname(socket.gethostname())


def start_group(cfg: RunConfig) -> TrainerGroup | None:
    """This process's place in the trainer when trainer.processes > 1 (None for a one-process trainer). The
    processes have joined one JAX job already (distributed.initialize: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
    and JAX_PROCESS_ID, which `up` sets, or a Cloud TPU slice / GKE JobSet that JAX detects)."""
    n = cfg.trainer.processes
    if n == 1:
        return None
    if not jax.distributed.is_initialized() or jax.process_count() != n:
        raise ValueError(f"trainer.processes={n}, but this process is in a JAX job of "
                         f"{jax.process_count() if jax.distributed.is_initialized() else 1} processes: start one "
                         "trainer process per host with JAX_COORDINATOR_ADDRESS (process 0's host:port), "
                         "JAX_NUM_PROCESSES and JAX_PROCESS_ID set, or on a TPU slice with distributed.initialize "
                         "auto, and set trainer.processes to the number of hosts")
    from jax._src.distributed import global_state  # noqa: PLC0415 - the runtime's key-value store (Orbax uses it too)

    group = TrainerGroup(n, jax.process_index(), global_state.client)
    log.info("trainer process %d of %d (%d local devices of %d)", group.index, n, jax.local_device_count(),
             jax.device_count())
    return group
