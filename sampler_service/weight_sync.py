"""Installing published weights on this sampler's mesh: one policy (WeightSync), three fetchers.

Fetchers (chosen by weights.transport) find the newest version and bring it
onto this sampler's devices with its own sharding:
  GrpcFetcher        asks the trainer only for the slices its devices hold, over
                     `fetch_streams` parallel streams, and places each slice on its
                     devices (jax.make_array_from_callback); nothing else is copied;
  CheckpointFetcher  reads LATEST from weights.checkpoint_dir and restores with Orbax
                     straight into this sharding;
  LocalFetcher       same process: jax.device_put from the trainer's arrays.
WeightSync owns the rules: a version is installed whole or not at all (with
`background`, fetched on a thread while generation goes on and handed over only
when complete, so the caller switches between batches), a new
trainer epoch (restarted trainer) is followed even when its numbers are lower,
failed fetches back off exponentially (the sampler keeps its version), and
`too_stale` says when generating would only make groups the trainer drops.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import socket
import time
from typing import Any, Callable

import grpc
import jax
import numpy as np

from grpo_stream.common.weights import tcp_wire as weight_bulk
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.common.model.policy import PolicyModel
from grpo_stream.common.model.sharding import needed_slices, param_shardings
from grpo_stream.common.weights.checkpoint_store import CheckpointWeightStore
from grpo_stream.common.weights.local_hub import LocalWeightHub
from grpo_stream.common.weights.snapshot import SliceAssembler, WeightTransferError, box_shape, box_to_proto, manifest_of
from grpo_stream.protos import weights_pb2, weights_pb2_grpc
from grpo_stream.sampler_service.receive_buffers import ReceiveBuffers

log = logging.getLogger(__name__)
QUICK_WAIT_S = 0.5  # how long poll() waits for a background check or fetch before generation goes on


@dataclasses.dataclass
class Installed:
    version: int
    params: Any
    final: bool
    fetch_seconds: float
    nbytes: int
    epoch: str = ""


@functools.partial(jax.jit, static_argnums=1)
def _cast(arr: jax.Array, dtype) -> jax.Array:
    return arr.astype(dtype)


def _box_key(box: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop) for s in box)


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class GrpcFetcher:
    """`data_host`: the trainer's host, to take slice bytes from its TCP data plane when the manifest announces
    one (weights.data_plane=tcp); None = always FetchSlices over gRPC."""

    def __init__(self, channel: grpc.Channel, sampler_id: str, streams: int, timeout_s: float,
                 data_host: str | None = None, security: ClientSecurity | None = None):
        """`security`: the token (and TLS context) the TCP data plane needs, as the gRPC channel has them."""
        self._stub = weights_pb2_grpc.WeightServiceStub(channel)
        self.security = security
        self.sampler_id, self.streams, self.timeout_s, self.data_host = sampler_id, streams, timeout_s, data_host
        self._warned = False
        self._buffers = ReceiveBuffers()  # what the data plane receives into (see receive_buffers.py)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=streams, thread_name_prefix="fetch")

    def latest(self, installed_version: int) -> weights_pb2.WeightManifest | None:
        try:
            return self._stub.GetManifest(weights_pb2.GetManifestRequest(
                sampler_id=self.sampler_id, installed_version=installed_version), timeout=min(10, self.timeout_s))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def fetch(self, manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> dict:
        index = {t.name: i for i, t in enumerate(manifest.tensors)}
        _check_names(manifest, targets)
        plan = []  # (bytes, tensor index, boxes)
        for name, target in targets.items():
            spec = manifest.tensors[index[name]]
            boxes = needed_slices(tuple(spec.shape), target.sharding)
            size = sum(int(np.prod([s.stop - s.start for s in b])) for b in boxes) * np.dtype(spec.dtype).itemsize
            plan.append((size, index[name], boxes))
        # balance the streams by bytes: largest tensors first, each to the lightest stream
        lanes: list[list] = [[] for _ in range(min(self.streams, len(plan)) or 1)]
        loads = [0] * len(lanes)
        for item in sorted(plan, key=lambda p: -p[0]):
            k = loads.index(min(loads))
            lanes[k].append(item)
            loads[k] += item[0]
        names = {index[name]: name for name in targets}

        def place(t: int, pieces: dict) -> jax.Array:
            # each device takes its slice (on CPU an aligned receive buffer is used in place), then a wire
            # dtype other than the model's is cast on the device
            target = targets[names[t]]
            shape = tuple(target.shape)
            arr = jax.make_array_from_callback(shape, target.sharding, lambda idx: pieces[_index_key(idx, shape)])
            return arr if arr.dtype == target.dtype else _cast(arr, target.dtype)

        stream = self._stream_tcp if self.data_host and manifest.data_port else self._stream
        futures = [self._pool.submit(stream, manifest, lane, place) for lane in lanes if lane]
        placed: dict[int, jax.Array] = {}
        for future in futures:
            placed.update(future.result(timeout=self.timeout_s + 5))
        out = {name: placed[index[name]] for name in targets}
        jax.block_until_ready(list(out.values()))
        return out

    def _stream(self, manifest, lane, place) -> dict[int, jax.Array]:
        """The lane's slices over FetchSlices, placed: tensor index -> array."""
        request = self._request(manifest, lane)
        assembler = SliceAssembler(manifest, {t: boxes for _, t, boxes in lane})
        for chunk in self._stub.FetchSlices(request, timeout=self.timeout_s):
            assembler.add(chunk)
        arrays = assembler.arrays()
        return {t: place(t, {_box_key(box): arr for box, arr in zip(boxes, arrays[t])}) for _, t, boxes in lane}

    def _fall_back(self, manifest, why: str) -> None:
        if not self._warned:
            log.warning("%s: weights data plane %s:%d unusable (%s); fetching over gRPC instead",
                        self.sampler_id, self.data_host, manifest.data_port, why)
            self._warned = True

    def _request(self, manifest, lane) -> weights_pb2.FetchSlicesRequest:
        return weights_pb2.FetchSlicesRequest(
            sampler_id=self.sampler_id, version=manifest.version, trainer_epoch=manifest.trainer_epoch,
            tensors=[weights_pb2.TensorSlices(tensor_index=t, slices=[box_to_proto(b) for b in boxes])
                     for _, t, boxes in lane])

    def _stream_tcp(self, manifest, lane, place) -> dict[int, jax.Array]:
        """The lane's slices over the TCP data plane, each received straight into its array and checked; each
        tensor is placed on the devices as soon as its slices are in (while the other lanes still receive)."""
        deadline = time.monotonic() + self.timeout_s
        sock = None
        try:
            sock = socket.create_connection((self.data_host, manifest.data_port), timeout=min(5, self.timeout_s))
            security = self.security or ClientSecurity()
            if security.ssl_context is not None:
                sock = security.ssl_context.wrap_socket(sock, server_hostname=security.server_name or self.data_host)
            sock.sendall(weight_bulk.encode_request(self._request(manifest, lane).SerializeToString(),
                                                    security.token))
            code, message = weight_bulk.read_status(sock, min(deadline, time.monotonic() + 10))
        except (OSError, WeightTransferError) as exc:  # port unreachable (firewall, Service without it) or silent
            if sock is not None:
                sock.close()
            self._fall_back(manifest, f"{type(exc).__name__}: {exc}")
            return self._stream(manifest, lane, place)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:  # all data-plane transfers busy
            sock.close()
            return self._stream(manifest, lane, place)
        with sock:
            if code:
                name = next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
                raise WeightTransferError(f"weights data plane answered {name}: {message}")
            placed: dict[int, jax.Array] = {}
            for _, t, boxes in lane:
                spec = manifest.tensors[t]
                pieces = {}
                for k, box in enumerate(boxes):
                    key = _box_key(box)
                    arr = self._buffers.take((t, key), box_shape(box), spec.dtype)
                    weight_bulk.receive_slice(sock, t, k, arr, spec.name, deadline)
                    pieces[key] = arr
                placed[t] = place(t, pieces)
            return placed


class CheckpointFetcher:
    def __init__(self, store: CheckpointWeightStore):
        self.store = store

    def latest(self, installed_version: int) -> weights_pb2.WeightManifest | None:
        record = self.store.latest()
        if record is None:
            return None
        specs = {n: (s, np.dtype(d)) for n, s, d in record["tensors"]}
        return manifest_of(record["version"], specs, record["final"], record["epoch"], record["published_unix"], 0,
                           "checkpoint", record["location"])

    def fetch(self, manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> dict:
        _check_names(manifest, targets)
        record = {"location": manifest.location, "tensors": [[t.name, list(t.shape), t.dtype]
                                                             for t in manifest.tensors]}
        return self.store.restore(record, targets)


class LocalFetcher:
    def __init__(self, hub: LocalWeightHub):
        self.hub = hub
        self._entry = None

    def latest(self, installed_version: int) -> weights_pb2.WeightManifest | None:
        entry = self._entry = self.hub.latest()
        if entry is None:
            return None
        specs = {n: (tuple(a.shape), np.dtype(a.dtype)) for n, a in entry.named.items()}
        return manifest_of(entry.version, specs, entry.final, entry.epoch, entry.published_unix, 0, "local")

    def fetch(self, manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> dict:
        entry = self._entry
        if entry is None or entry.version != manifest.version or entry.epoch != manifest.trainer_epoch:
            raise WeightTransferError(f"version {manifest.version} was replaced while installing; poll again")
        return LocalWeightHub.install(entry, targets)


def _check_names(manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> None:
    specs = {t.name: t for t in manifest.tensors}
    missing, extra = sorted(set(targets) - set(specs)), sorted(set(specs) - set(targets))
    if missing or extra:
        raise WeightTransferError(f"published parameters differ from this sampler's model (missing {missing[:3]}, "
                                  f"unexpected {extra[:3]}); do both services use the same model config?")
    for name, target in targets.items():
        if tuple(specs[name].shape) != tuple(target.shape):
            raise WeightTransferError(f"{name}: published shape {list(specs[name].shape)}, this sampler's model "
                                      f"wants {list(target.shape)}")


class WeightSync:
    """Polls a fetcher and installs newer versions whole; reports the installed version to the trainer. `clock`
    (time.monotonic by default) times the back-off after a failed fetch; a test moves it instead of waiting."""

    def __init__(self, fetcher, model: PolicyModel, mesh: jax.sharding.Mesh, sampler_id: str,
                 retry_initial_s: float = 0.5, retry_max_s: float = 10.0, max_staleness: int | None = None,
                 channel: grpc.Channel | None = None, background: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.fetcher, self.model, self.sampler_id, self.clock = fetcher, model, sampler_id, clock
        self.retry_initial_s, self.retry_max_s, self.max_staleness = retry_initial_s, retry_max_s, max_staleness
        shardings = param_shardings(model.params, mesh)
        self.targets = {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s) for name, leaf, s in zip(
            model.names(), jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(shardings))}
        self._report_stub = None if channel is None else weights_pb2_grpc.WeightServiceStub(channel)
        self.throughput = (0.0, 0.0)  # (groups/s, tokens/s) the sampler reports with its version
        self.installed_version, self.installed_epoch = -1, ""
        self.latest_seen = -1  # newest version seen from the installed version's trainer epoch
        self.failures, self._next_attempt = 0, 0.0
        self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-fetch")
                      if background else None)
        self._pending: concurrent.futures.Future | None = None

    def lag(self) -> int:
        return max(0, self.latest_seen - self.installed_version) if self.installed_version >= 0 else 0

    def too_stale(self) -> bool:
        """True when groups made now would exceed the trainer's staleness bound (they would only be dropped)."""
        return self.max_staleness is not None and self.installed_version >= 0 and self.lag() > self.max_staleness

    def poll(self) -> Installed | None:
        """A newer version fetched whole, or None (nothing newer, still fetching in the background, backing off,
        or the fetch failed). Never raises on transport errors: the sampler keeps its version and retries after a
        back-off."""
        if self._pending is None:
            if self.clock() < self._next_attempt:
                return None
            if self._pool is None:
                return self._settle(self._check_and_fetch)
            self._pending = self._pool.submit(self._check_and_fetch)
            # most checks (and small fetches) finish within milliseconds: take their outcome now rather than a
            # poll interval later; anything slower carries on in the background
            concurrent.futures.wait([self._pending], timeout=QUICK_WAIT_S)
        if not self._pending.done():
            return None
        pending, self._pending = self._pending, None
        return self._settle(pending.result)

    def has_result(self) -> bool:
        """A background check or fetch has finished: the next poll() returns its outcome."""
        return self._pending is not None and self._pending.done()

    def _settle(self, attempt) -> Installed | None:
        try:
            got = attempt()
        except Exception as exc:  # noqa: BLE001 - whatever a fetch meets, the sampler keeps its version
            self.failures += 1
            delay = min(self.retry_initial_s * 2 ** (self.failures - 1), self.retry_max_s)
            self._next_attempt = self.clock() + delay
            detail = (f"{exc.code()}: {exc.details()}" if isinstance(exc, grpc.RpcError)
                      else f"{type(exc).__name__}: {exc}")
            log.warning("%s weight fetch failed (%s); keeping version %d (lag %d), retry %d in %.1fs",
                        self.sampler_id, detail, self.installed_version, self.lag(), self.failures, delay)
            self.report()
            return None
        if got is not None and got.params is not None:
            self.failures = 0
        return got

    def _check_and_fetch(self) -> Installed | None:
        manifest = self.fetcher.latest(self.installed_version)
        if manifest is None:
            return None
        new_epoch = manifest.trainer_epoch != self.installed_epoch
        if not new_epoch:
            self.latest_seen = max(self.latest_seen, manifest.version)
        if not new_epoch and (manifest.version < self.installed_version or (
                manifest.version == self.installed_version and not manifest.final)):
            return None
        if not new_epoch and manifest.version == self.installed_version:
            return Installed(manifest.version, None, True, 0.0, 0, manifest.trainer_epoch)
        log.info("%s fetching weight version %d (%.1f MB, %s)", self.sampler_id, manifest.version,
                 manifest.total_bytes / 1e6, manifest.transport)
        start = time.monotonic()
        named = self.fetcher.fetch(manifest, self.targets)
        params = self.model.params_from_arrays(named)
        jax.block_until_ready(params)
        return Installed(manifest.version, params, manifest.final, time.monotonic() - start, manifest.total_bytes,
                         manifest.trainer_epoch)

    def close(self) -> None:
        """Stop background fetching (a fetch in flight ends at its deadline; its result is dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def mark_installed(self, got: Installed) -> None:
        if got.epoch != self.installed_epoch:
            self.latest_seen = got.version
        self.installed_version, self.installed_epoch = got.version, got.epoch
        self.latest_seen = max(self.latest_seen, got.version)
        self.report()

    def report(self) -> None:
        """Tell the trainer which version runs here and how fetching goes (best effort, short deadline)."""
        if self._report_stub is None:
            return
        try:
            reply = self._report_stub.ReportVersion(weights_pb2.VersionReport(
                sampler_id=self.sampler_id, installed_version=self.installed_version, fetch_failures=self.failures,
                trainer_epoch=self.installed_epoch, groups_per_s=self.throughput[0], tokens_per_s=self.throughput[1]),
                timeout=2)
            if reply.latest_version >= 0:
                self.latest_seen = max(self.latest_seen, reply.latest_version)
        except grpc.RpcError:
            pass
