"""Issue 41, finding 2, against a real JAX coordination service on loopback: two joined clients play trainer
processes 0 and 1 (TrainerGroup, as multihost.py runs them) and an intruder that never joined writes into the
service's key-value store over its gRPC API (tests/coordinator_intruder.py). Before the seal, the intruder's
`grpo/msg/0` written ahead made process 0's send fail (ALREADY_EXISTS) and one written over process 0's reached
process 1 as its batch. Now: keys written ahead are never read and never stop the writer; a message or announcement
overwritten, forged or replayed is refused with an error naming its key, and never acted on. The two-process
trainer under attack runs in tests/e2e/test_multihost_forgery.py."""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from jax._src.lib import _jax

from grpo_stream.common.model.sharding import coordinator_bind_address
from grpo_stream.common.rollouts.redis_server import free_port
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.control_messages import ControlCodec, ControlMessageError
from grpo_stream.trainer_service.multihost import TrainerGroup
from tests.coordinator_intruder import LOOPBACK, Intruder

BATCH = {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4), "advantages": np.array([1.0, -1.0, 0.5], np.float32)}


@pytest.fixture
def job(monkeypatch):
    """(process 0's group, process 1's group, the intruder) around one real coordination service."""
    monkeypatch.setenv("GRPO_STREAM_ADVERTISE_HOST", "127.0.0.1")
    address = f"127.0.0.1:{free_port()}"
    service = _jax.get_distributed_runtime_service(address, 2, heartbeat_timeout=60, shutdown_timeout=5)
    clients = [_jax.get_distributed_runtime_client(address, k, init_timeout=30, use_compression=True,
                                                   heartbeat_timeout=60) for k in range(2)]
    together(client.connect for client in clients)
    codec = ControlCodec(b"q" * 64, b"\x05" * 16)  # one secret and incarnation, as join_group agrees them
    intruder = Intruder(address)
    try:
        yield TrainerGroup(2, 0, clients[0], codec), TrainerGroup(2, 1, clients[1], codec), intruder
    finally:
        intruder.close()
        together(client.shutdown for client in clients)  # a barrier: both at once
        service.shutdown()


def together(calls) -> None:
    threads = [threading.Thread(target=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


def old_format(fields: dict, arrays: dict) -> bytes:
    """A message as the unsealed code wrote it: header length, JSON, npz."""
    header, body = json.dumps(fields).encode(), io.BytesIO()
    np.savez(body, **arrays)
    return len(header).to_bytes(8, "little") + header + body.getvalue()


def new_keys(intruder: Intruder, seen: dict) -> dict[str, bytes]:
    return {k: v for k, v in intruder.listing("grpo/").items() if k not in seen}


def test_keys_written_ahead_neither_stop_process_0_nor_reach_process_1(job):
    leader, follower, intruder = job
    forged_finish = old_format({"kind": "finish", "steps": 0, "complete": False, "checkpoint": False,
                                "publish": False}, {})
    for k in range(12):  # every name the unsealed code used, and junk beside them
        intruder.put(f"grpo/msg/{k}", forged_finish)
        intruder.put(f"grpo/weights/e1/{k}/1", json.dumps({"address": "203.0.113.9", "port": 1,
                                                           "data_port": 1}).encode())
    intruder.put("grpo/msg/", b"junk")
    leader.send("start", {"epoch": "e1", "restore": None})  # ALREADY_EXISTS here before the fix
    leader.send("step", {"step": 1, "checkpoint": False, "publish": True}, BATCH)
    start, _ = follower.receive("start")
    message, arrays = follower.receive("step", "finish")
    assert start.epoch == "e1" and message.kind == "step" and message.step == 1
    np.testing.assert_array_equal(arrays["advantages"], BATCH["advantages"])
    follower.announce("e1", 1, 5001, 5002)
    leader.announce("e1", 1, 5003, 5004)
    manifest = weights_pb2.WeightManifest(trainer_epoch="e1", version=1)
    leader.hosts_of(manifest, timeout_s=10)
    assert [(h.address, h.port, h.data_port) for h in manifest.hosts] == [("127.0.0.1", 5003, 5004),
                                                                         ("127.0.0.1", 5001, 5002)]


@pytest.mark.parametrize("attack", ["forged_finish", "poisoned_batch", "replay_of_an_earlier_message"])
def test_a_message_overwritten_before_process_1_reads_it_stops_it_with_an_error_naming_it(job, attack):
    leader, follower, intruder = job
    leader.send("start", {"epoch": "e1", "restore": 2})
    seen = intruder.listing("grpo/")
    assert len(seen) == 1  # the intruder can see every key once it is written
    follower.receive("start")
    leader.send("step", {"step": 3, "checkpoint": True, "publish": False}, BATCH)
    (key, authentic), = new_keys(intruder, seen).items()
    if attack == "forged_finish":
        value = old_format({"kind": "finish", "steps": 3, "complete": False, "checkpoint": False, "publish": False},
                           {})
    elif attack == "poisoned_batch":  # the authentic frame with one advantage's sign flipped
        value = authentic.replace(bytes(BATCH["advantages"]), bytes(BATCH["advantages"] * [1, 1, -1]))
        assert value != authentic
    else:
        value = seen[next(iter(seen))]  # the start message, authentic but message 0
    intruder.put(key, value)
    problem = {"forged_finish": "is not a sealed trainer message",
               "poisoned_batch": r"fails authentication \(bad MAC\)",
               "replay_of_an_earlier_message": "is msg message 0: a replayed or reordered message"}[attack]
    with pytest.raises(ControlMessageError, match=f"at key {key} .*{problem}"):
        follower.receive("step", "finish")


def test_a_forged_or_replayed_host_announcement_never_reaches_the_manifest(job):
    """Samplers send their bearer tokens to every host the manifest lists."""
    leader, follower, intruder = job
    seen = intruder.listing("grpo/")
    follower.announce("e1", 4, 5001, 5002)
    (theirs, _), = new_keys(intruder, seen).items()
    leader.announce("e1", 4, 5003, 5004)
    (mine, own), = new_keys(intruder, {**seen, theirs: b""}).items()
    intruder.put(theirs, own)  # process 0's own authentic announcement, replayed as process 1's
    manifest = weights_pb2.WeightManifest(trainer_epoch="e1", version=4)
    with pytest.raises(ControlMessageError, match=f"key {theirs}: the announcement names trainer process 0"):
        leader.hosts_of(manifest, timeout_s=10)
    intruder.put(theirs, json.dumps({"address": "203.0.113.9", "port": 50151, "data_port": 50152}).encode())
    with pytest.raises(ControlMessageError, match=f"at key {theirs} .*trainer process 1's address.*not a sealed"):
        leader.hosts_of(manifest, timeout_s=10)
    assert "203.0.113.9" not in str(manifest)


def test_the_coordinator_listens_where_the_job_says():
    """JAX binds every interface ([::]:port) unless told: a job on one host (as `up` runs it) keeps it on loopback,
    JAX_COORDINATOR_BIND_ADDRESS chooses (a pod's IP), and a job across hosts keeps JAX's default."""
    assert coordinator_bind_address("127.0.0.1:1234", {}) == "127.0.0.1:1234"
    assert coordinator_bind_address("[::1]:1234", {}) == "[::1]:1234"
    assert coordinator_bind_address("localhost:1234", {}) == "localhost:1234"
    assert coordinator_bind_address("trainer-0.svc:1234", {}) is None
    assert coordinator_bind_address("10.0.0.5:1234", {"JAX_COORDINATOR_BIND_ADDRESS": "10.0.0.5:1234"}) == \
        "10.0.0.5:1234"
    port = free_port()
    child = subprocess.run(
        [sys.executable, "-c", "import jax; from grpo_stream.common.model.sharding import initialize_distributed; "
         "from tests.coordinator_intruder import listening_addresses; initialize_distributed('auto'); "
         f"print(sorted(listening_addresses({port}))); jax.distributed.shutdown()"],
        capture_output=True, text=True, timeout=120, cwd=pathlib.Path(__file__).parents[2],
        env={**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "1",
             "JAX_PROCESS_ID": "0"})
    assert child.returncode == 0, child.stderr[-3000:]
    listeners = set(json.loads(child.stdout.strip().splitlines()[-1].replace("'", '"')))
    assert listeners and listeners <= LOOPBACK, listeners  # before: {'000...000'}, i.e. [::], every interface
