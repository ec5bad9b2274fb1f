"""The trainer's books (checkpoints/durability.py) against a real redis-server: a Redis at maxmemory does not
deadlock them, and a trainer that a newer one fenced out writes no checkpoint. The checkpoint store is a stand-in
(what it has committed is set by the test); everything the books write goes to Redis."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.buffer import BufferUnavailable, Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect
from grpo_stream.common.rollouts.trainer_lease import StaleTrainer, TrainerLease
from grpo_stream.trainer_service.checkpoints.durability import Durability
from tests.integration.test_audit_compaction import damaged_run

pytestmark = pytest.mark.redis

PAYLOAD = b"x" * 200_000  # large groups: settling two frees ~400 KB


class Checkpoints:
    """The checkpoint store as Durability sees it: saves recorded, commits announced by the test."""

    directory = "stand-in"

    def __init__(self):
        self.saved: list[int] = []
        self.done: list[int] = []

    def save(self, step, state, record, token):
        self.saved.append(step)

    def committed(self, wait=False):
        done, self.done = self.done, []
        return [(step, step) for step in done]


def books(buf, stop=None, compact=False) -> tuple[Durability, Checkpoints]:
    cfg = load_config(None, [f"run.name={buf.run_name}", f"buffer.compact_audit={compact}"])
    store = Checkpoints()
    return Durability(cfg, buf, store, "e1", stop), store


def picked(entries):
    return [(e, SimpleNamespace(sampler_id="s0", data_position=i)) for i, e in enumerate(entries)]


def settled_memory(client) -> int:
    """Redis's used memory once the buffers of the large commands before are released (within a second)."""
    used = client.info("memory")["used_memory"]
    for _ in range(15):
        time.sleep(0.2)
        used, before = client.info("memory")["used_memory"], used
        if abs(used - before) < 4096:
            break
    return used


def test_a_step_at_maxmemory_settles_what_is_acknowledged_first_instead_of_waiting_forever():
    """Redis at maxmemory (noeviction) refuses the step's audit record and held count, and the ingest's appends:
    only settling frees memory, and the trainer used to settle only after those records, so it waited forever.
    Here checkpoint 2 is on disk, so step 1's groups may be acknowledged: the refused record settles them first."""
    server = EmbeddedRedis().start()
    stop = threading.Event()
    try:
        client = connect(server.url, 5)
        buf = RedisStreamBuffer(client, "oom")
        durability, store = books(buf, stop)
        buf.log_trainer("e1", 0, "")
        buf.append_many([Incoming(f"oom/s0/{i}", "s0", 0, i, PAYLOAD) for i in range(6)], max_groups=100)
        entries = buf.read(6, block_ms=100)
        durability.trained(1, picked(entries[0:2]))
        store.done.append(1)
        durability.committed()
        durability.trained(2, picked(entries[2:4]))
        store.done.append(2)  # its checkpoint is on disk; the books have not looked yet
        client.config_set("maxmemory", settled_memory(client) - 100_000)
        with pytest.raises(BufferUnavailable, match="OOM|maxmemory"):
            buf.log_step("probe", 0, [])  # every write but a settle is refused now

        books_done = threading.Thread(target=durability.trained, args=(3, picked(entries[4:6])), daemon=True)
        books_done.start()
        books_done.join(10)
        assert not books_done.is_alive(), "the step's books wait for memory that only their settle frees"
        counters = buf.counters()
        assert counters["trained"] == 2 and counters["depth"] == 4  # step 1's groups acknowledged, and gone
        assert [int(r[1][b"step"]) for r in client.xrange(buf.k["audit:steps"])] == [1, 2, 3]
        assert int(client.get(buf.k["held"])) == 4  # steps 2 and 3 held for their checkpoints
        durability.committed()  # checkpoint 2's record, written once there is room again
        assert [int(r[1][b"step"]) for r in client.xrange(buf.k["audit:checkpoints"])] == [1, 2]
        assert buf.counters()["trained"] == 2  # nothing settled twice, nothing more than checkpoint 2 allows
    finally:
        stop.set()
        server.stop()


def test_a_trainer_fenced_out_saves_no_checkpoint(shared_redis, run_name):
    """The checkpoint is the one write outside Redis: a trainer whose run a newer trainer took (its lease lapsed
    while it was paused) must stop before it, not overwrite the newer trainer's checkpoints."""
    old, new = (RedisStreamBuffer(connect(shared_redis.url, 5), run_name) for _ in range(2))
    refused: list[str] = []
    TrainerLease.take(old, 5.0, None, on_stale=refused.append, renew=False)
    old.client.delete(old.k["trainer:lease"])  # lapsed: the old trainer was paused past its TTL
    TrainerLease.take(new, 5.0, None, on_stale=refused.append, renew=False)
    updater = SimpleNamespace(params={}, opt_state={}, ref_params=None, split=lambda params: (params, None))

    stale, stale_store = books(old)
    with pytest.raises(StaleTrainer, match="a newer trainer took the run over"):
        stale.save(4, updater, {})
    assert stale_store.saved == [] and len(refused) == 1  # told the trainer (its handler exits), wrote nothing

    current, store = books(new)
    current.save(4, updater, {})
    assert store.saved == [4] and len(refused) == 1


def test_a_damaged_audit_record_is_logged_at_each_checkpoint_not_fatal(shared_redis, run_name, caplog):
    """The trainer compacts the trail at every acknowledged checkpoint: a record no trainer wrote used to stop it
    there with a bare JSONDecodeError, at every restart again. Now compaction holds back, and the log names it."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    damaged_run(buf, "accepted")
    durability, store = books(buf, compact=True)
    store.done += [1, 2]
    with caplog.at_level(logging.WARNING):
        durability.committed()
    assert "audit trail not compacted through step 1" in caplog.text
    assert f"HDEL {buf.k['audit:accepted']} foreign" in caplog.text
