"""The count bound on kept results (common/rollouts/kept_results.py) orders finished prompts by the finishing
process's clock. A prompt finished by an ingest whose clock is behind the one that finished the kept prompts before
it (another ingest host, a clock stepped back) sorted lowest, and the bound evicted it in the very call that
finished it: its result was deleted before its client could read it."""

import time

import pytest

from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.kept_results import FINISHED_KEY
from grpo_stream.common.rollouts.redis_server import connect

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("train", ["1", "0"])
def test_a_prompt_finished_under_a_clock_behind_keeps_its_result(shared_redis, run_name, train):
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    r, base = buf.client, buf.base
    r.zadd(f"{base}:{FINISHED_KEY}", {"earlier": time.time() + 600})  # finished by a clock ten minutes ahead
    r.hset(f"{base}:prompt:earlier", mapping={"state": "done", "result": "x"})
    r.hset(f"{base}:prompt:p1", mapping={"state": "claimed", "train": train, "client": "c1"})
    r.hset(f"{base}:inject:pending", "c1", 1)
    answer = Incoming(f"{run_name}/inj/p1", "s0", 0, -1, b"answer", injected_prompt="p1")
    statuses, _ = buf.append_many([answer], max_groups=10, max_kept=1)
    assert statuses[0] != "unknown"
    assert r.hget(f"{base}:prompt:p1", "state") == b"done" and r.hget(f"{base}:prompt:p1", "result") == b"answer"
    assert r.zscore(f"{base}:{FINISHED_KEY}", "p1") is not None
    assert not r.exists(f"{base}:prompt:earlier")  # the bound still holds: the one before it left
