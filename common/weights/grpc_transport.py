"""The `grpc` weight transport: samplers take from the trainer only the slices their devices hold.

The trainer keeps a host copy of each published version (a WeightSnapshot, taken by host_staging.py: asynchronous
copies, through pinned memory where the accelerator has it, into host buffers reused across versions) and serves it
from its WeightService (FetchSlices, chunked and checksummed) and, with weights.data_plane=tcp, from a raw TCP data
plane on another port (tcp_wire.py) that a sampler falls back from to gRPC when it cannot reach it. A sampler asks
over `weights.fetch_streams` parallel streams, balanced by bytes, receives each slice into an aligned buffer reused
across versions (receive_buffers.py) and places it on its devices with one batched transfer per array
(jax.make_array_from_callback, the target's sharding): nothing else is copied, and on CPU not even that.

This module is the sink and the client; the server half, which only the trainer runs, is
trainer_service/publication/grpc_transport_server/.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import socket
import threading
import time
import weakref

import grpc
import jax
import numpy as np

from grpo_stream.common.model.sharding import needed_slices
from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.common.runtime.errors import TRANSIENT_GRPC, PermanentError
from grpo_stream.common.weights import tcp_wire
from grpo_stream.common.weights.fetch_lanes import FetchCancelled, FetchLanes, shut
from grpo_stream.common.weights.host_staging import HostStaging
from grpo_stream.common.weights.host_shards import add_sources, host_shard_snapshot, relative, split_box
from grpo_stream.common.weights.receive_buffers import ReceiveBuffers
from grpo_stream.common.weights.snapshot import (BASE_VERSION, SliceAssembler, WeightSnapshot, WeightTransferError,
                                                 box_key, box_shape, box_to_proto)
from grpo_stream.common.weights.transport import SinkContext, SourceContext, WeightsMismatch, check_names
from grpo_stream.protos import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)
DATA_PLANE_RETRY_S = 300.0  # a data plane that could not be reached is tried again after this long



def grpc_target(address: str, port: int) -> str:
    """`address:port` as gRPC reads a target: an IPv6 address in brackets (a pod IP on an IPv6 cluster, as a
    trainer process advertises it); `fd00::1:50151` bare names no host gRPC can reach."""
    return f"[{address}]:{port}" if ":" in address and not address.startswith("[") else f"{address}:{port}"

class GrpcSink:
    """A host copy of the version; the trainer's WeightService serves its bytes. `staging`: how the copy is taken
    (host_staging.py: asynchronous copies into host buffers reused across versions on accelerators)."""

    def __init__(self, chunk_bytes: int, staging: HostStaging | None = None):
        self.chunk_bytes = chunk_bytes
        self.staging = staging or HostStaging()

    def put(self, version, named, final, epoch, now, *, adapters=None):
        sources = None
        if any(isinstance(a, jax.Array) and not a.is_fully_addressable for a in named.values()):
            host, sources = host_shard_snapshot(named)  # a multi-host trainer: this process's boxes only
        else:
            host = self.staging.to_host(named)
        snapshot = WeightSnapshot(version, host, final, epoch, now)
        manifest = snapshot.manifest(self.chunk_bytes, "grpc")
        if sources is not None:
            add_sources(manifest, sources)
        if adapters is not None:  # samplers read it from GetManifest, which serves this manifest
            manifest.adapters.CopyFrom(adapters)
        return manifest, snapshot


def make_sink(ctx: SinkContext) -> GrpcSink:
    return GrpcSink(ctx.weights.chunk_bytes)


def make_source(ctx: SourceContext) -> "GrpcFetcher":
    w = ctx.weights
    return GrpcFetcher(ctx.channel, ctx.sampler_id, w.fetch_streams, ctx.rpc_timeout_s,
                       data_host=ctx.trainer_host if w.data_plane == "tcp" else None, security=ctx.security)


@functools.partial(jax.jit, static_argnums=1)
def _cast(arr: jax.Array, dtype) -> jax.Array:
    return arr.astype(dtype)


def _pieces(_t: int, pieces: dict) -> dict:
    """A `place` that keeps a lane's received slices as host arrays (multi-host: assembled after every host's)."""
    return pieces


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def check_wire_dtypes(manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> None:
    """Every tensor's wire dtype must be one the sampler receives bytes into and casts to its parameter's dtype (a
    float, integer or bool dtype); WeightsMismatch (permanent: every retry reads the same manifest) naming the
    manifest field, before any buffer is taken or byte moves."""
    for i, spec in enumerate(manifest.tensors):
        if spec.name not in targets:
            continue
        try:
            dtype = np.dtype(spec.dtype)
        except (TypeError, ValueError):  # not a dtype; a subarray shape past a C int (ValueError)
            dtype = None
        if dtype is None or not any(jax.numpy.issubdtype(dtype, kind) for kind in
                                    (jax.numpy.floating, jax.numpy.integer, jax.numpy.bool_)):
            raise WeightsMismatch(f"weights version {manifest.version}: tensors[{i}].dtype={spec.dtype!r} ({spec.name})"
                                  f" is not a float, integer or bool dtype this sampler can cast to its "
                                  f"{np.dtype(targets[spec.name].dtype).name}; run trainer and sampler from the same "
                                  "grpo-stream version (weights.wire_dtype: model, float32 or bfloat16)")


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
        # data planes (host, port, trainer epoch) that could not be reached -> until when they are not tried again
        self._unusable: dict[tuple[str, int, str], float] = {}
        self._buffers = ReceiveBuffers()  # what the data plane receives into (see receive_buffers.py)
        self._host_stubs: dict[str, weights_pb2_grpc.WeightServiceStub] = {}  # a multi-host trainer's other hosts
        self._host_channels: list[grpc.Channel] = []  # their channels (closed by close())
        self._multi_host_logged = False
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=streams, thread_name_prefix="fetch")
        self._pool_size = streams
        # the fetches in flight, ended by close(): a data-plane lane is a raw socket (channel.close() does not end
        # it) in a pool thread the interpreter joins at exit, so a stopped sampler lived on until the fetch ended
        self._attempts: weakref.WeakSet[FetchLanes] = weakref.WeakSet()
        self._attempts_lock, self._closed = threading.Lock(), False

    def latest(self, installed_version: int) -> weights_pb2.WeightManifest | None:
        try:
            return self._stub.GetManifest(weights_pb2.GetManifestRequest(
                sampler_id=self.sampler_id, installed_version=installed_version), timeout=min(10, self.timeout_s))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def fetch(self, manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> dict:
        if manifest.version != BASE_VERSION:
            return self._fetch(manifest, targets)
        # LoRA's frozen base comes once per trainer epoch: buffers kept for reuse would hold a host copy of it
        # (wherever placing copies: accelerators, a wire dtype cast on the device) until the next epoch's base, so
        # it is received into buffers of its own, freed with the base (on CPU they are its parameters)
        kept, self._buffers = self._buffers, ReceiveBuffers()
        try:
            return self._fetch(manifest, targets)
        finally:
            self._buffers = kept

    def _fetch(self, manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> dict:
        index = {t.name: i for i, t in enumerate(manifest.tensors)}
        check_names(manifest, targets)
        check_wire_dtypes(manifest, targets)
        if len(manifest.hosts) > 1:
            return self._fetch_hosts(manifest, targets, index)
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
        attempt = self._attempt(self._pool)
        for lane in lanes:
            if lane:
                attempt.submit(stream, manifest, lane, place)
        placed: dict[int, jax.Array] = {}
        for result in attempt.results():
            placed.update(result)
        out = {name: placed[index[name]] for name in targets}
        jax.block_until_ready(list(out.values()))
        return out

    def close(self) -> None:
        """Stop the fetch threads and close the channels to a multi-host trainer's other hosts (a fetch in flight
        is ended: its calls cancelled, its sockets shut; nothing waits for it)."""
        with self._attempts_lock:
            self._closed, attempts = True, list(self._attempts)
        for attempt in attempts:
            attempt.abort()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in self._host_channels:
            channel.close()

    def _attempt(self, pool: concurrent.futures.Executor) -> FetchLanes:
        """A fetch's lanes, ended by close() (FetchCancelled once closed)."""
        attempt = FetchLanes(pool, self.timeout_s + 5)
        with self._attempts_lock:
            if self._closed:
                raise FetchCancelled("the weight fetcher was closed")
            self._attempts.add(attempt)
        return attempt

    def _pool_for(self, lanes: int) -> concurrent.futures.ThreadPoolExecutor:
        """The pool, grown to run `lanes` at once: a multi-host fetch has a lane per trainer process, and one queued
        behind another host's whole transfer asked for the version only once that ended; a trainer that publishes
        more often than that had replaced it by then (NOT_FOUND: the fetch failed, and so did every retry)."""
        if lanes > self._pool_size:
            old, self._pool_size = self._pool, lanes
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="fetch")
            old.shutdown(wait=False)
        return self._pool

    def _host_stub(self, manifest, host: int):
        """The WeightService stub of trainer process `host` (0: the trainer this sampler was pointed at)."""
        if host == 0:
            return self._stub
        where = manifest.hosts[host]
        address = grpc_target(where.address, where.port)
        if address not in self._host_stubs:
            channel = open_channel(address, self.security)
            self._host_channels.append(channel)
            self._host_stubs[address] = weights_pb2_grpc.WeightServiceStub(channel)
        return self._host_stubs[address]

    def _fetch_hosts(self, manifest, targets, index) -> dict:
        """A multi-host trainer's version: each box this sampler's devices need is split along the hosts that
        serve its parts (the manifest's sources), every host's parts are fetched in parallel (over its data plane
        when it has one), and the boxes are assembled and placed."""
        if not self._multi_host_logged:
            log.info("%s: weights from %d trainer processes (%s)", self.sampler_id, len(manifest.hosts),
                     ", ".join(f"{h.address}:{h.port}" for h in manifest.hosts))
            self._multi_host_logged = True
        wanted: dict[int, list] = {}  # tensor index -> [(box, [(host, part)], assembled array)]
        per_host: dict[int, dict[int, list]] = {}  # host -> tensor index -> parts
        into: dict[tuple, np.ndarray] = {}  # (tensor, part): where in an assembled box the data plane receives it
        for name, target in targets.items():
            t = index[name]
            spec = manifest.tensors[t]
            for box in needed_slices(tuple(spec.shape), target.sharding):
                parts = split_box(box, spec, len(manifest.hosts))
                # an aligned buffer that becomes the parameter on CPU (as the one-host path's receive buffers); its
                # own key: a part received over gRPC (a separate buffer, copied in) may have the box's bounds
                out = self._buffers.take((t, box_key(box), "assembled"), box_shape(box), spec.dtype)
                wanted.setdefault(t, []).append((box, parts, out))
                for host, part in parts:
                    per_host.setdefault(host, {}).setdefault(t, []).append(part)
                    rel = relative(part, box)
                    view = out[rel] if rel else out  # (indexing a 0-d array with () gives a scalar copy, not a view)
                    if view.flags.c_contiguous:  # e.g. rows of an fsdp-sharded weight: no copy after receiving
                        into[(t, box_key(part))] = view
        attempt = self._attempt(self._pool_for(len(per_host)))
        for host, tensors in per_host.items():
            lane = [(0, t, boxes) for t, boxes in tensors.items()]
            where = manifest.hosts[host]
            data_host = (self.data_host if host == 0 else where.address) if self.data_host else None
            if data_host and where.data_port:
                attempt.submit(self._stream_tcp, manifest, lane, _pieces, data_host, where.data_port,
                               self._host_stub(manifest, host), into)
            else:
                attempt.submit(self._stream, manifest, lane, _pieces, self._host_stub(manifest, host))
        got: dict[int, dict] = {}
        for result in attempt.results():
            for t, pieces in result.items():
                got.setdefault(t, {}).update(pieces)
        out = {}
        for name, target in targets.items():
            t, shape = index[name], tuple(target.shape)
            boxes = {}
            for box, parts, arr in wanted[t]:
                for _, part in parts:  # parts not received in place (gRPC, or not contiguous) are copied in
                    piece = got[t][box_key(part)]
                    if into.get((t, box_key(part))) is not piece:
                        arr[relative(part, box)] = piece
                boxes[box_key(box)] = arr
            placed = jax.make_array_from_callback(shape, target.sharding, lambda idx: boxes[_index_key(idx, shape)])
            out[name] = placed if placed.dtype == target.dtype else _cast(placed, target.dtype)
        jax.block_until_ready(list(out.values()))
        return out

    def _stream(self, manifest, lane, place, stub=None, *, lanes: FetchLanes) -> dict[int, jax.Array]:
        """The lane's slices over FetchSlices (of `stub`'s trainer process; default the trainer's), placed:
        tensor index -> array. The call is cancelled when another of the fetch's `lanes` fails."""
        request = self._request(manifest, lane)
        # into aligned buffers reused across versions, as the data plane's: placed without a copy on CPU
        assembler = SliceAssembler(manifest, {t: boxes for _, t, boxes in lane}, take=self._buffers.take)
        call = (stub or self._stub).FetchSlices(request, timeout=self.timeout_s)
        lanes.opened(call.cancel)
        for chunk in call:
            assembler.add(chunk)
        arrays = assembler.arrays()
        return {t: place(t, {box_key(box): arr for box, arr in zip(boxes, arrays[t])}) for _, t, boxes in lane}

    def _fall_back(self, host: str, port: int, why: str) -> None:
        if not self._warned:
            log.warning("%s: weights data plane %s:%d unusable (%s); fetching over gRPC instead",
                        self.sampler_id, host, port, why)
            self._warned = True

    def _request(self, manifest, lane) -> weights_pb2.FetchSlicesRequest:
        return weights_pb2.FetchSlicesRequest(
            sampler_id=self.sampler_id, version=manifest.version, trainer_epoch=manifest.trainer_epoch,
            tensors=[weights_pb2.TensorSlices(tensor_index=t, slices=[box_to_proto(b) for b in boxes])
                     for _, t, boxes in lane])

    def _stream_tcp(self, manifest, lane, place, host=None, port=None, stub=None, into=None, *,
                    lanes: FetchLanes) -> dict[int, jax.Array]:
        """The lane's slices over the TCP data plane (of the trainer process at `host`:`port`; default the
        trainer's), each received straight into its array and checked; each tensor is placed on the devices as
        soon as its slices are in (while the other lanes still receive). Falls back to FetchSlices of `stub`.
        `into`: (tensor index, box key) -> the array to receive that slice into (multi-host: inside its assembled
        box); others go to receive buffers. The socket is shut when another of the fetch's `lanes` fails."""
        deadline = time.monotonic() + self.timeout_s
        host, port = host or self.data_host, port or manifest.data_port
        plane = (host, port, manifest.trainer_epoch)
        if time.monotonic() < self._unusable.get(plane, 0.0):  # unreachable lately: not paid for at every fetch
            return self._stream(manifest, lane, place, stub, lanes=lanes)
        security = self.security or ClientSecurity()
        if not tcp_wire.token_fits(security.token):  # gRPC metadata carries it whole; the data plane's field cannot
            self._fall_back(host, port, f"the auth token is longer than its {tcp_wire.MAX_TOKEN_BYTES} bytes; use a "
                            "shorter token to fetch over it")
            return self._stream(manifest, lane, place, stub, lanes=lanes)
        try:
            sock = socket.create_connection((host, port), timeout=min(5, self.timeout_s))
        except OSError as exc:  # port unreachable (a firewall, a Service without it): tried again in a while
            self._unusable[plane] = time.monotonic() + DATA_PLANE_RETRY_S
            self._fall_back(host, port, f"{type(exc).__name__}: {exc}")
            return self._stream(manifest, lane, place, stub, lanes=lanes)
        try:
            lanes.opened(functools.partial(shut, sock))
            if security.ssl_context is not None:
                sock = security.ssl_context.wrap_socket(sock, server_hostname=security.server_name or host)
                lanes.opened(functools.partial(shut, sock))
            sock.sendall(tcp_wire.encode_request(self._request(manifest, lane).SerializeToString(),
                                                    security.token))
            code, message = tcp_wire.read_status(sock, min(deadline, time.monotonic() + 10))
        except (OSError, WeightTransferError) as exc:  # silent, or the connection dropped: this fetch over gRPC
            sock.close()
            lanes.check()  # unless it was shut because another lane failed: then the fetch is over
            # and the next ones too for a while: a port that accepts and never answers (a proxy, another service)
            # would otherwise cost every fetch the status wait (10 s)
            self._unusable[plane] = time.monotonic() + DATA_PLANE_RETRY_S
            self._fall_back(host, port, f"{type(exc).__name__}: {exc}")
            return self._stream(manifest, lane, place, stub, lanes=lanes)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:  # all data-plane transfers busy
            sock.close()
            return self._stream(manifest, lane, place, stub, lanes=lanes)
        with sock:
            if code:
                name = next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))
                if name not in TRANSIENT_GRPC and name != "NOT_FOUND":  # as the same refusal over gRPC: not retried
                    raise PermanentError(f"weights data plane answered {name}: {message}")
                raise WeightTransferError(f"weights data plane answered {name}: {message}")
            placed: dict[int, jax.Array] = {}
            for _, t, boxes in lane:
                spec = manifest.tensors[t]
                pieces = {}
                for k, box in enumerate(boxes):
                    key = box_key(box)
                    arr = (into or {}).get((t, key))
                    if arr is None:
                        arr = self._buffers.take((t, key), box_shape(box), spec.dtype)
                    tcp_wire.receive_slice(sock, t, k, arr, spec.name, deadline)
                    pieces[key] = arr
                placed[t] = place(t, pieces)
            return placed
