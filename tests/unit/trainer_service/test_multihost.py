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
