"""The trainer's lease in a real Redis when a reply is lost or its keys hold another type.

A TAKE that Redis ran but whose reply never arrived (the connection dropped after the script; the take is tried
again) left the lease in this very trainer's name: the retry found it held by "another trainer" (its own pid) and
waited the whole trainer.lease_ttl_s for it. A lease or fence key of another type failed with a bare WRONGTYPE
naming no key, as a failure `up` restarts (exit 1) though no restart can mend it."""

from __future__ import annotations

import threading

import pytest
import redis

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.trainer_lease import LeaseDamaged, TrainerLease

pytestmark = pytest.mark.redis


def test_a_take_whose_reply_was_lost_is_this_trainers_not_another_one_to_wait_for(shared_redis, run_name):
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    lease = TrainerLease(buf, 600.0)  # without the fix the retry waits out this TTL
    ran = lease._take
    replies = []

    def reply_lost_once(**kwargs):
        replies.append(ran(**kwargs))
        if len(replies) == 1:  # Redis ran it; the connection dropped before the reply arrived
            raise redis.ConnectionError("Connection reset by peer")
        return replies[-1]

    lease._take = reply_lost_once
    stop = threading.Event()
    timer = threading.Timer(5.0, stop.set)  # without the fix the wait only ends here, with StopRequested
    timer.start()
    try:
        lease._acquire(stop)
    finally:
        timer.cancel()
    assert int(replies[0][0]) == 1 and lease.fence > int(replies[0][2])  # taken again, under a newer fence
    assert buf.client.get(buf.k["trainer:fence"]) == str(lease.fence).encode()
    assert buf.client.get(buf.k["trainer:lease"]) == lease.value.encode()


@pytest.mark.parametrize("which", ["trainer:lease", "trainer:fence"])
def test_a_lease_or_fence_key_of_another_type_is_a_permanent_refusal_naming_it(shared_redis, run_name, which):
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    key = buf.k[which]
    buf.client.hset(key, "f", "1")
    with pytest.raises(LeaseDamaged, match=f"{key} is a hash, not the string.*DEL {key}\\)"):
        TrainerLease.take(buf, 1.0, None, renew=False)
    assert buf.client.type(key) == b"hash" and not buf.client.exists(buf.k["trainer:lease" if which != "trainer:lease"
                                                                            else "trainer:fence"])
