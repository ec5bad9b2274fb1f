"""The messages trainer process 0 sends the others (multi-process trainer), and the config's limits. The real
key-value store and the two-process job run in tests/e2e/test_multihost_trainer.py; here a dict stands in for
the store (logic only)."""

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.control_messages import ControlCodec, ControlMessageError
from grpo_stream.trainer_service.multihost import KEEP_MESSAGES, TrainerGroup

CODEC = ControlCodec(b"k" * 64, b"\x07" * 16)


def group(index: int, store) -> TrainerGroup:
    return TrainerGroup(2, index, store, CODEC)


class Store:
    """The key-value calls TrainerGroup makes, on a dict; a missing key times out as the runtime's does."""

    def __init__(self):
        self.values = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.values
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.values:
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key} and duration: 60s")
        return self.values[key]

    def key_value_delete(self, key):
        self.values.pop(key, None)


def test_messages_arrive_in_order_with_their_arrays_and_old_ones_are_dropped():
    store = Store()
    leader, follower = group(0, store), group(1, store)
    leader.send("start", {"epoch": "abc", "restore": 4})
    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
    leader.send("step", {"step": 1, "checkpoint": False, "publish": True}, {"tokens": tokens, "valid": tokens > 3})
    message, arrays = follower.receive("start")
    assert (message.kind, message.epoch, message.restore) == ("start", "abc", 4) and arrays == {}
    message, arrays = follower.receive("step", "finish")
    assert (message.kind, message.step, message.checkpoint, message.publish) == ("step", 1, False, True)
    np.testing.assert_array_equal(arrays["tokens"], tokens)
    assert arrays["valid"].dtype == np.bool_ and arrays["valid"].sum() == 8
    for k in range(2, 10):
        leader.send("step", {"step": k, "checkpoint": False, "publish": False})
    assert len(store.values) == KEEP_MESSAGES


def test_a_follower_waits_through_timeouts_for_a_slow_leader():
    """A step can take process 0 longer than one wait on the store (samplers slow to deliver groups)."""
    class Slow(Store):
        waits = 0

        def blocking_key_value_get_bytes(self, key, timeout_ms):
            self.waits += 1
            if self.waits == 3:  # the message arrives during the third wait
                group(0, self).send("step", {"step": 7, "checkpoint": True, "publish": True})
            # the runtime's timeout error reads "DEADLINE_EXCEEDED: GetKeyValue() timed out with key: ..."
            return super().blocking_key_value_get_bytes(key, timeout_ms)

    store = Slow()
    message, _ = group(1, store).receive("step")
    assert (message.kind, message.step) == ("step", 7) and store.waits == 3


def test_a_follower_whose_leader_is_gone_stops_with_a_clear_error():
    class Gone(Store):
        def blocking_key_value_get_bytes(self, key, timeout_ms):
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")

    with pytest.raises(RuntimeError, match="lost trainer process 0 .* restarts from its newest checkpoint"):
        group(1, Gone()).receive()


@pytest.mark.parametrize("extra, word", [(["weights.transport=checkpoint"], "weights.transport=grpc"),
                                         (["trainer.mesh.fsdp=3"], "fsdp x tp = 3 devices")])
def test_a_multi_process_trainer_refuses_what_it_cannot_run(extra, word):
    with pytest.raises(ValueError, match="trainer.processes=2") as err:
        load_config(None, ["trainer.processes=2", "trainer.mesh.fsdp=4", *extra])
    assert word in str(err.value)


def test_an_authentic_message_out_of_protocol_order_stops_the_follower():
    """Process 0 and this process disagree on where they are (e.g. different grpo-stream versions): a clear error,
    never a silent mismatch of collectives."""
    store = Store()
    group(0, store).send("step", {"step": 1, "checkpoint": False, "publish": False})
    with pytest.raises(ControlMessageError, match="message 0 from trainer process 0 is 'step' where start comes"):
        group(1, store).receive("start")


class TwoHosts:
    """jax.experimental.multihost_utils as this process sees a job of two: process 0's incarnation, and every
    process's row of the allgather (this one's, then another process's on machine `other`, advertising `state`, with
    its secret)."""

    def __init__(self, other: str, state: int):
        self.other, self.state = other, state

    def broadcast_one_to_all(self, value):
        return value

    def process_allgather(self, mine):
        import hashlib

        theirs = np.frombuffer(hashlib.sha256(self.other.encode()).digest()[:8] + bytes([self.state, 0]), np.uint8)
        return np.stack([np.asarray(mine), theirs])


@pytest.mark.parametrize("advertised, other, refused", [
    ("127.0.1.1", "host-b", True),  # Debian's /etc/hosts: the host name resolves to loopback, on two machines
    ("localhost", "host-b", True),
    ("127.0.0.1", "host-a", False),  # every process on this machine, as `up` runs them
    ("10.0.0.5", "host-b", False),  # the pod IPs
])
def test_a_job_across_machines_refuses_loopback_advertisements_in_every_process(monkeypatch, advertised, other,
                                                                                 refused):
    """Samplers fetch each process's slices from its advertised address: a loopback one on a job across machines
    reaches no sampler elsewhere, and the run would wait for fresh groups for ever. Every process sees the same
    rows, so all refuse together (none is left waiting in a collective)."""
    from jax.experimental import multihost_utils

    from grpo_stream.trainer_service import multihost
    from grpo_stream.trainer_service.checkpoints.errors import RunRefused
    from grpo_stream.trainer_service.control_messages import SECRET_ENV

    fake = TwoHosts(other, multihost.LOOPBACK if advertised.startswith("127.") else 0)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", fake.broadcast_one_to_all)
    monkeypatch.setattr(multihost_utils, "process_allgather", fake.process_allgather)
    monkeypatch.setattr(multihost.socket, "gethostname", lambda: "host-a")
    monkeypatch.setenv(SECRET_ENV, "s" * 64)
    monkeypatch.setenv(multihost.ADVERTISE_ENV, advertised)
    if refused:
        with pytest.raises(RunRefused, match=r"loopback address while the job runs on 2 machines.*"
                                             r"GRPO_STREAM_ADVERTISE_HOST on every trainer process"):
            multihost.join_group(2, 1, Store())
    else:
        assert multihost.join_group(2, 1, Store()).index == 1


def test_processes_sharing_a_machine_on_any_loopback_name_serve_on_ports_of_their_own(monkeypatch):
    """Process k on process 0's machine (advertised on loopback) takes trainer.port + k: also when the loopback is
    named `localhost` or `::1`, where it took process 0's port and failed to start."""
    from grpo_stream.trainer_service import follower

    cfg = load_config(None, ["trainer.processes=2", "trainer.mesh.fsdp=4", "trainer.port=50151", "auth.mode=none"])
    seen = []
    monkeypatch.setattr(follower, "TrainerServer", lambda *args, **kwargs: seen.append(args[3]))
    for host in ("127.0.0.1", "localhost", "::1", "10.0.0.5"):
        monkeypatch.setenv("GRPO_STREAM_ADVERTISE_HOST", host)
        follower.follower_server(cfg, 1, None)
    assert seen == [50152, 50152, 50152, 50151]


def test_a_process_whose_host_name_does_not_resolve_refuses_with_the_others(monkeypatch):
    """Without GRPO_STREAM_ADVERTISE_HOST, a host name that does not resolve failed only at the first publication's
    announcement (after the warm start), and the restarted job met it again."""
    import socket

    from jax.experimental import multihost_utils

    from grpo_stream.trainer_service import multihost
    from grpo_stream.trainer_service.checkpoints.errors import RunRefused
    from grpo_stream.trainer_service.control_messages import SECRET_ENV

    def no_such_host(name):
        raise socket.gaierror(-2, "Name or service not known")

    fake = TwoHosts("host-b", 0)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", fake.broadcast_one_to_all)
    monkeypatch.setattr(multihost_utils, "process_allgather", fake.process_allgather)
    monkeypatch.setattr(multihost.socket, "gethostname", lambda: "host-a")
    monkeypatch.setattr(multihost.socket, "gethostbyname", no_such_host)
    monkeypatch.setenv(SECRET_ENV, "s" * 64)
    monkeypatch.delenv(multihost.ADVERTISE_ENV, raising=False)
    with pytest.raises(RunRefused, match=r"trainer process\(es\) \[0\] cannot resolve their host name"):
        multihost.join_group(2, 0, Store())


def test_config_digests_that_do_not_read_stop_every_process_for_a_restart_not_a_refusal(monkeypatch):
    """Process 0's config digests overwritten in the store (a writer on the coordinator port): the process that reads
    them still takes part in the verdict's collective, so process 0 is not left waiting in it, and both stop with
    ControlMessageError (the job restarts), not the permanent refusal of configs that differ."""
    from jax.experimental import multihost_utils

    from grpo_stream.trainer_service import multihost

    cfg = load_config(None, ["trainer.processes=2", "trainer.mesh.fsdp=4"])
    store = Store()
    gathered = []

    def allgather(mine):  # this process's row beside the other process's, which reads process 0's digests fine
        gathered.append(np.asarray(mine))
        return np.stack([np.zeros_like(mine), np.asarray(mine)])

    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    leader, follower = group(0, store), group(1, store)
    key = CODEC.key("settings", 0)
    store.values[key] = b"forged"  # written over process 0's
    with pytest.raises(ControlMessageError, match=f"at key {key} .*trainer process 0's config.*not a sealed"):
        multihost.check_same_config(follower, cfg)
    assert gathered[-1][-1] == multihost.SETTINGS_UNREAD
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda mine: np.stack([np.asarray(mine), gathered[-1]]))  # process 0 learns it
    with pytest.raises(ControlMessageError, match=r"trainer process\(es\) \[1\] could not read trainer process 0's "
                                                  "config digests"):
        multihost.check_same_config(leader, cfg)


def test_config_digests_reveal_no_value_and_leave_out_host_local_settings():
    """The store is readable from the coordinator port: a setting's value, a guessable one included, must not be
    learnable from its digest without the secret. Paths, logging and the compilation cache are each host's own."""
    from grpo_stream.trainer_service.multihost import config_digests

    cfg = load_config(None, ["trainer.processes=2", "trainer.mesh.fsdp=4", "run.name=hunter2"])
    digests = config_digests(cfg, CODEC)
    other = config_digests(cfg, ControlCodec(b"j" * 64, b"\x07" * 16))
    assert digests["run.name"] != other["run.name"] and "hunter2" not in str(digests)
    assert "trainer.learning_rate" in digests and "checkpoint.dir" not in digests and "model.path" not in digests
    assert not [name for name in digests if name.startswith(("logging.", "runtime."))]
