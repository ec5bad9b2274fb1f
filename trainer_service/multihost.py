"""A trainer of several JAX processes (trainer.processes > 1): multi-controller JAX, one process per host.

Every process holds its shards of the parameters and optimizer state and runs every program (the update,
evaluation, checkpoint saves) in the same order; the collectives between them are XLA's (ICI/DCN on a TPU slice,
NCCL on GPUs, Gloo between CPU processes). Process 0 leads: it alone serves the ingest, prompts and status, reads
the buffer and acknowledges groups, and it sends every other process what they cannot decide alone, in order:
each step's batch and whether that step checkpoints and publishes, and the end of the run. The messages travel
through the key-value store of JAX's distributed runtime (the coordination service process 0 runs), not through a
device collective: a batch's shape changes from step to step and would compile a broadcast per shape. That store
takes writes from anything reaching the coordinator port, so every message and announcement is sealed with the
job's secret and checked on receipt (control_messages.py): a forged, overwritten or replayed one is never acted
on (the process that reads it stops the job with an error naming it), and the keys' names cannot be guessed (so a
key written ahead cannot be read first, nor make the writer fail). Process 0 also decides the checkpoint step every
process restores and sends it in the first message (checkpoints/store.py: a process that cannot read that step stops
instead of restoring another). What a message does not carry each process derives from its config, so before anything
else every process checks that its config is process 0's (check_same_config: a job started with another override on
one host is refused in every process, naming the settings that differ).

Each process serves its own slices of each published version (common/weights/host_shards.py); process 0's
manifest lists every process's address and switches to a version only once all of them serve it.

If any process dies the others cannot go on (their collectives would wait for it for ever): the whole job stops
and restarts from the newest checkpoint, as a JobSet restarts its pods and `up` restarts its trainer processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import ipaddress
import json
import logging
import os
import socket
from typing import Any

import jax
import numpy as np

from grpo_stream.common.config.base import dotted_settings
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.checkpoints.errors import RunRefused
from grpo_stream.trainer_service.control_messages import (SECRET_ENV, SECRET_FILE_ENV, STREAMS, ControlCodec,
                                                          ControlMessageError, Hosts, Settings, load_secret)
from grpo_stream.trainer_service.learning.batching import TrainBatch

log = logging.getLogger(__name__)

ADVERTISE_ENV = "GRPO_STREAM_ADVERTISE_HOST"  # the address samplers reach this process at (e.g. the pod IP)
WAIT_MS = 60_000  # one wait on the store; a follower waits for the next message for as long as the leader needs
PUBLISH_WAIT_S = 600.0  # process 0 waits this long for the others to serve a version they publish with it
KEEP_MESSAGES = 4  # messages kept in the store: each one's work meets a collective before the leader sends more


class TrainerGroup:
    """This process's place in a multi-process trainer and the channel from process 0 to the others. Every value it
    writes into the store is sealed by `codec` (control_messages.py) and every value it reads is opened by it."""

    def __init__(self, processes: int, index: int, client: Any, codec: ControlCodec):
        self.processes, self.index, self._client, self._codec = processes, index, client, codec
        self._sent = self._received = 0
        self._announced: list[tuple[str, int]] = []  # (epoch, version) whose announcements process 0 read

    @property
    def leader(self) -> bool:
        return self.index == 0

    # -- messages: process 0 -> every other process, in order --------------------------------------------------
    def send(self, kind: str, fields: dict | None = None, arrays: dict[str, np.ndarray] | None = None) -> None:
        """Process 0: send message `kind` (control_messages.py: start, step, finish, done) with its `fields` and numpy
        `arrays` to every other process."""
        message = STREAMS["msg"].validate_python({"kind": kind, **(fields or {})})
        seq = self._sent
        # overwriting: a key can only exist already if something wrote it in the job's name, and it is never read
        # before this write (its name is unguessable); refusing to write would stop the job (ALREADY_EXISTS)
        self._client.key_value_set_bytes(self._codec.key("msg", seq), self._codec.seal("msg", seq, message, arrays),
                                         allow_overwrite=True)
        if seq >= KEEP_MESSAGES:
            self._client.key_value_delete(self._codec.key("msg", seq - KEEP_MESSAGES))
        self._sent += 1

    def receive(self, *kinds: str) -> tuple[Any, dict[str, np.ndarray]]:
        """Another process: the next message from process 0, (message, arrays), one of `kinds`; waits as long as
        needed. Raises ControlMessageError when the value there is not process 0's next message (forged, replayed,
        overwritten or of another kind than the protocol expects here: the job stops rather than act on it), and
        RuntimeError when process 0 is gone (its coordination service answers no more)."""
        seq = self._received
        key = self._codec.key("msg", seq)
        message, arrays = self._codec.open("msg", seq, self._wait(key), f"key {key} of the coordination service")
        if kinds and message.kind not in kinds:
            raise ControlMessageError(f"trainer process {self.index}: message {seq} from trainer process 0 is "
                                      f"{message.kind!r} where {' or '.join(kinds)} comes in the protocol: the "
                                      "processes run different versions of grpo-stream")
        self._received += 1
        return message, arrays

    def _wait(self, key: str) -> bytes:
        """The value process 0 writes at `key`, as long as that takes; RuntimeError when process 0 is gone."""
        while True:
            try:
                return self._client.blocking_key_value_get_bytes(key, WAIT_MS)
            except Exception as exc:  # noqa: BLE001 - jaxlib raises one error type; a timeout only means "not yet"
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise RuntimeError(f"trainer process {self.index}: lost trainer process 0 ({exc}); the job "
                                       "stops and restarts from its newest checkpoint") from exc

    # -- the config: the same in every process --------------------------------------------------------------------
    def leader_settings(self, cfg: RunConfig) -> tuple[dict[str, str], dict[str, str]]:
        """(this process's settings, process 0's), each a setting's dotted name to its keyed digest: process 0
        publishes its own, the others read them. ControlMessageError when the value read is not process 0's."""
        mine = config_digests(cfg, self._codec)
        key = self._codec.key("settings", 0)
        if self.leader:
            self._client.key_value_set_bytes(key, self._codec.seal("settings", 0, Settings(digests=mine)),
                                             allow_overwrite=True)  # as in send: never read before this write
            return mine, mine
        theirs, _ = self._codec.open("settings", 0, self._wait(key), f"key {key} (trainer process 0's config)")
        return mine, theirs.digests

    # -- weight publication from every process ------------------------------------------------------------------
    def announce(self, epoch: str, version: int, port: int, data_port: int) -> None:
        """Every process: it serves its slices of `version` of trainer epoch `epoch` at its address."""
        where = Hosts(epoch=epoch, version=version, process=self.index, address=advertised_host(), port=port,
                      data_port=data_port)
        self._client.key_value_set_bytes(self._codec.key("hosts", version, epoch, self.index),
                                         self._codec.seal("hosts", version, where), allow_overwrite=True)

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
        """Process 0: wait until every process serves `manifest`'s version, then list them in `manifest.hosts`.
        Raises ControlMessageError when an announcement is not authentic (samplers would send their tokens to
        whoever wrote it)."""
        manifest.ClearField("hosts")
        epoch, version = manifest.trainer_epoch, manifest.version
        for p in range(self.processes):
            key = self._codec.key("hosts", version, epoch, p)
            try:
                raw = self._client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(f"trainer process {p} did not serve weight version {version} within "
                                   f"{timeout_s:.0f}s ({exc})") from exc
            where, _ = self._codec.open("hosts", version, raw, f"key {key} (trainer process {p}'s address for "
                                        f"weight version {version})")
            if (where.epoch, where.version, where.process) != (epoch, version, p):
                raise ControlMessageError(f"key {key}: the announcement names trainer process {where.process}, "
                                          f"version {where.version} of epoch {where.epoch!r}, where trainer process "
                                          f"{p}'s of version {version} of epoch {epoch!r} was expected")
            manifest.hosts.add(address=where.address, port=where.port, data_port=where.data_port)
        self._announced.append((epoch, version))
        if len(self._announced) > 2:  # older announcements are never read again
            old_epoch, old_version = self._announced.pop(0)
            for p in range(self.processes):
                self._client.key_value_delete(self._codec.key("hosts", old_version, old_epoch, p))


def ignore_signals() -> None:
    """Trainer processes other than 0 ignore SIGTERM/SIGINT/SIGHUP: process 0 stops the job (a checkpoint by all of
    them), and they exit when it tells them or when it is gone."""
    import signal  # noqa: PLC0415

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def advertised_host() -> str:
    """Where samplers reach this process: GRPO_STREAM_ADVERTISE_HOST (set it to the pod IP on Kubernetes), else
    the address this host's name resolves to."""
    return os.environ.get(ADVERTISE_ENV) or socket.gethostbyname(socket.gethostname())


def is_loopback(host: str) -> bool:
    """Whether `host` (an advertised address) names this machine's loopback interface."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        return False


def start_group(cfg: RunConfig) -> TrainerGroup | None:
    """This process's place in the trainer when trainer.processes > 1 (None for a one-process trainer). The
    processes have joined one JAX job already (distributed.initialize: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
    and JAX_PROCESS_ID, which `up` sets, or a Cloud TPU slice / GKE JobSet that JAX detects)."""
    n = cfg.trainer.processes
    joined = jax.process_count() if jax.distributed.is_initialized() else 1
    if n == 1 and joined > 1:
        # every process would run as the only trainer (its own lease, ingest and plans) on a mesh over every
        # process's devices (make_mesh spreads it), waiting in collectives the others never enter
        raise RunRefused(f"trainer.processes=1, but this process is one of a JAX job of {joined} processes "
                         "(distributed.initialize joined them: JAX_COORDINATOR_ADDRESS, or a TPU slice of several "
                         f"hosts): set trainer.processes={joined} to train over all of them, or "
                         "distributed.initialize=never to run a trainer of this host alone")
    if n == 1:
        return None
    if joined != n:
        raise RunRefused(f"trainer.processes={n}, but this process is in a JAX job of {joined} processes: start one "
                         "trainer process per host with JAX_COORDINATOR_ADDRESS (process 0's host:port), "
                         "JAX_NUM_PROCESSES and JAX_PROCESS_ID set, or on a TPU slice with distributed.initialize "
                         "auto, and set trainer.processes to the number of hosts")
    from jax._src.distributed import global_state  # noqa: PLC0415 - the runtime's key-value store (Orbax uses it too)

    group = join_group(n, jax.process_index(), global_state.client)
    check_same_config(group, cfg)
    log.info("trainer process %d of %d (%d local devices of %d)", group.index, n, jax.local_device_count(),
             jax.device_count())
    return group


def join_group(processes: int, index: int, client: Any) -> TrainerGroup:
    """This process's TrainerGroup in a JAX job that has joined already: the shared secret from the environment
    (control_messages.load_secret) and this start's incarnation, which every process calls for together."""
    try:
        secret, lacking = load_secret(), None
    except ValueError as exc:  # told to the others in check_advertised_hosts: alone, this process would leave them
        secret, lacking = b"", exc  # waiting in agree_incarnation's collective (on GPUs and TPUs: for ever)
    incarnation = agree_incarnation()
    check_advertised_hosts(lacking)
    return TrainerGroup(processes, index, client, ControlCodec(secret, incarnation))


def agree_incarnation() -> bytes:
    """16 random bytes of process 0, the same in every process: broadcast over the job's own collective (not the
    key-value store, where anyone reaching the coordinator could plant an old incarnation to replay old messages
    into). A collective: every process calls it once, at the same point of its start."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    mine = np.frombuffer(os.urandom(16), np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(mine), np.uint8).tobytes()


# settings each host may set for itself: where it finds its files (a shared checkpoint.dir or a model mounted at a
# path of its own, its secrets and certificates), its compilation cache (its $HOME), its CPUs and how it logs
HOST_LOCAL_SECTIONS = ("runtime", "logging")
HOST_LOCAL_SUFFIXES = ("path", "dir", "_file", "cpu_affinity")
SETTINGS_DIFFER, SETTINGS_UNREAD = 1, 2  # a process's verdict on its config (0: the same as process 0's)
MAX_SETTINGS = 2048  # settings compared (a config has about 300): one byte each in check_same_config's gather


PROTOCOL_SETTING = "(grpo-stream version)"  # compared as a setting: what the processes send each other, and how


def protocol() -> str:
    """What this process's grpo-stream sends and reads between trainer processes: its version and the schemas of
    the control messages and of a step's batch. Processes of different versions (an image updated on some hosts)
    would fail on the first message the other cannot read, or run different programs and wait for each other."""
    try:
        version = importlib.metadata.version("grpo-stream")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    schemas = {stream: adapter.json_schema() for stream, adapter in STREAMS.items()}
    return json.dumps([version, schemas, [f.name for f in dataclasses.fields(TrainBatch)]], sort_keys=True)


def config_digests(cfg: RunConfig, codec: ControlCodec) -> dict[str, str]:
    """Each setting of `cfg` (dotted name) that must be the same in every trainer process, to its keyed digest, and
    this process's grpo-stream protocol (PROTOCOL_SETTING)."""
    digests = {name: codec.digest([name, value]) for name, value in dotted_settings(cfg.model_dump(mode="json")).items()
               if not (name.split(".")[0] in HOST_LOCAL_SECTIONS or name.endswith(HOST_LOCAL_SUFFIXES))}
    return {**digests, PROTOCOL_SETTING: codec.digest([PROTOCOL_SETTING, protocol()])}


def check_same_config(group: TrainerGroup, cfg: RunConfig) -> None:
    """Refuse, in every process at once, a job whose processes were started with different configs (another file,
    another override on one host): from the same plans they would run different programs (a warm start, an
    evaluation, another mesh or learning rate) and wait for each other in collectives for ever, or train on shards
    that do not belong together. Process 0 publishes its settings' keyed digests, each other process compares its
    own, and every process gathers which settings differ where (a collective: none is left waiting, and every
    process's error names them)."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    # a row: whether each of process 0's settings differs here, whether this process has settings process 0 has
    # not, and its verdict
    names, row, unread, only_mine = [], np.zeros(MAX_SETTINGS + 2, np.uint8), None, []
    try:
        mine, theirs = group.leader_settings(cfg)
        names = sorted(theirs)[:MAX_SETTINGS]
        row[:len(names)] = [mine.get(name) != theirs[name] for name in names]
        only_mine = sorted(set(mine) - set(theirs))
        if only_mine:  # an override of a mapping on this host only (task.rewards.NAME=...), or another version
            log.error("trainer process %d has settings trainer process 0 has not: %s", group.index, only_mine)
        row[-2] = bool(only_mine)
        row[-1] = SETTINGS_DIFFER if row.any() else 0
    except ControlMessageError as exc:  # forged or overwritten: told to the others too, then the job restarts
        unread, row[-1] = exc, SETTINGS_UNREAD
    rows = np.asarray(multihost_utils.process_allgather(row), np.uint8).reshape(-1, len(row))
    if unread is not None:
        raise unread
    if not (rows[:, -1] == SETTINGS_DIFFER).any():
        if (rows[:, -1] == SETTINGS_UNREAD).any():
            raise ControlMessageError(f"trainer process(es) {np.flatnonzero(rows[:, -1]).tolist()} could not read "
                                      "trainer process 0's config digests (their logs say why): the job stops")
        return
    differ = [f"{name} (process(es) {np.flatnonzero(rows[:, k]).tolist()})" for k, name in enumerate(names)
              if rows[:, k].any()]
    extra = np.flatnonzero(rows[:, -2]).tolist()
    what = ", ".join(differ[:20]) + (f" and {len(differ) - 20} more" if len(differ) > 20 else "")
    named = f"here: {', '.join(only_mine[:20])}" if only_mine else "their logs name them"
    what += f"{'; ' if what else ''}process(es) {extra} have settings process 0 has not ({named})" if extra else ""
    # the protocol alone tells versions apart: a setting only some processes have is a config's too (an override of
    # a mapping, task.rewards.NAME=..., given on one host), blamed on the version it sent users to reinstall
    skew = PROTOCOL_SETTING in names and rows[:, names.index(PROTOCOL_SETTING)].any()
    if skew:  # whatever else differs follows from that
        raise RunRefused(f"trainer processes run another version of grpo-stream than trainer process 0 ({what}): "
                         "their messages and programs differ. Install the same grpo-stream (the same image) on every "
                         "host of the trainer")
    raise RunRefused(f"trainer processes started with configs other than trainer process 0's: {what}. Every trainer "
                     "process must run the same config, or they run different programs and wait for each other for "
                     "ever: start each with the same --config file and overrides (`up` does); only the sections "
                     f"{', '.join(HOST_LOCAL_SECTIONS)}, paths (settings named *path, *dir, *_file) and cpu_affinity "
                     "may differ between hosts")


UNRESOLVED, LOOPBACK = 2, 1  # what a process's advertised address is, besides reachable (0)


def check_advertised_hosts(lacking: ValueError | None = None) -> None:
    """Refuse, in every process at once, a job where some process has no usable secret (`lacking`: why this one has
    not, control_messages.load_secret), or whose processes run on different machines (host names) while some
    would tell samplers to fetch their weight slices from a loopback address (a host name resolving to 127.0.1.1, as
    Debian's /etc/hosts makes it) or from none: no sampler on another machine reaches it, so none would ever install
    a version and the run would wait for fresh groups for ever. A collective, after agree_incarnation: the verdict is
    every process's, so none is left waiting for another."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    try:
        state = LOOPBACK if is_loopback(advertised_host()) else 0
    except OSError:  # the host name does not resolve: announce() would fail at the first publication
        state = UNRESOLVED
    name = hashlib.sha256(socket.gethostname().encode()).digest()[:8]
    mine = np.frombuffer(name + bytes([state, lacking is not None]), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine), np.uint8).reshape(-1, len(mine))
    if lacking is not None:
        raise RunRefused(str(lacking)) from lacking
    if every[:, -1].any():
        raise RunRefused(f"trainer process(es) {np.flatnonzero(every[:, -1]).tolist()} have no usable shared secret "
                         f"({SECRET_FILE_ENV} or {SECRET_ENV}; their logs say why): set the same one on every trainer "
                         "process of the job")
    problem = unreachable_hosts([row[:-2].tobytes() for row in every], [int(row[-2]) for row in every])
    if problem:
        raise RunRefused(problem)


def unreachable_hosts(names: list[bytes], states: list[int]) -> str | None:
    """The refusal of check_advertised_hosts for processes on hosts `names` whose advertised addresses are
    `states` (0, LOOPBACK, UNRESOLVED), None when samplers can reach every one."""
    unresolved = [k for k, s in enumerate(states) if s == UNRESOLVED]
    looped = [k for k, s in enumerate(states) if s == LOOPBACK] if len(set(names)) > 1 else []
    if not (unresolved or looped):
        return None
    what = [f"trainer process(es) {unresolved} cannot resolve their host name"] if unresolved else []
    what += [f"trainer process(es) {looped} would advertise a loopback address while the job runs on "
             f"{len(set(names))} machines"] if looped else []
    return (f"{'; '.join(what)}: samplers fetch each trainer process's weight slices from the address it advertises "
            f"({ADVERTISE_ENV}, else the address its host name resolves to). Set {ADVERTISE_ENV} on every trainer "
            "process to the address samplers reach its host at (the pod IP on Kubernetes: status.podIP), or make "
            "each host's name resolve to it")
