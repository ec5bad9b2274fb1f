"""The trainer's lease over values no trainer writes that its first checks let through: a fence too large for the
take script's arithmetic (Lua numbers are doubles) and a lease holder nested too deeply for Python's JSON parser."""

from __future__ import annotations

import threading

import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.trainer_lease import LeaseDamaged, TrainerLease, parse_value

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("fence", ["9007199254740992", "9" * 25])
def test_a_fence_past_what_the_take_can_add_one_to_is_refused_naming_it(shared_redis, run_name, fence):
    """2**53 + 1 is 2**53 in a double: the take handed out the very fence the run held (two trainers whose writes
    both pass the check); 25 digits made it '-9223372036854775808', which the next start refused as damaged."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    buf.client.set(buf.k["trainer:fence"], fence)
    with pytest.raises(LeaseDamaged, match=f"{buf.k['trainer:fence']} holds .*not a fencing number.*"
                                           f"DEL {buf.k['trainer:fence']}"):
        TrainerLease.take(buf, 1.0, None, renew=False)
    assert buf.client.get(buf.k["trainer:fence"]) == fence.encode() and not buf.client.exists(buf.k["trainer:lease"])


def test_a_lease_holder_nested_past_the_json_parsers_depth_is_refused_naming_the_key(shared_redis, run_name):
    """json.loads raised RecursionError, which parse_value did not catch: the trainer died with a traceback naming
    no key at every start, instead of LeaseDamaged naming the lease and its fix."""
    value = "7 " + "[" * 100_000
    assert parse_value(value) == (-1, None)
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    key = buf.k["trainer:lease"]
    buf.client.set(key, value, px=60_000)
    take_refused(buf, f"{key} .*DEL {key}")


def test_a_damaged_fence_of_a_run_named_like_a_redis_code_is_refused_not_waited_on(shared_redis, run_name):
    """'OOM-...' is a valid run name; the fence's refusal names its key, and that read as Redis out of memory: the
    trainer retried 'Redis unavailable' for ever instead of stopping with the key and its fix."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), f"OOM-{run_name}")
    buf.client.set(buf.k["trainer:fence"], "x")
    take_refused(buf, f"{buf.k['trainer:fence']} holds \"x\", not a fencing number")


def take_refused(buf: RedisStreamBuffer, match: str) -> None:
    """A take refused with LeaseDamaged matching `match`, not waited on (a stop after 3 s ends a wait)."""
    stop = threading.Event()
    timer = threading.Timer(3.0, stop.set)
    timer.start()
    try:
        with pytest.raises(LeaseDamaged, match=match):
            TrainerLease.take(buf, 1.0, stop, renew=False)
    finally:
        timer.cancel()
