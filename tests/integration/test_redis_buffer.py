"""The Redis-streams buffer against a real redis-server: accounting, de-duplication, idempotent settling,
recovery of a dead trainer's entries, durability across a Redis crash, and the audit built from its trail. The
contract every backend keeps (`any_buf`) runs on each backend of the registry: Redis and in memory."""

import pytest

from grpo_stream.common.rollouts.buffer import BufferUnavailable, Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, RedisConnectError, connect, free_port
from grpo_stream.common.rollouts.registry import BUFFERS, open_buffer
from grpo_stream.reports.audit import build_audit, lineage

pytestmark = pytest.mark.redis


def inc(i, sampler="s0", position=None):
    return Incoming(f"run/{sampler}/{i}", sampler, 0, i if position is None else position, f"g{i}".encode())


def identity_holds(c):
    return c["ingested"] == (c["trained"] + c["dropped_stale"] + c["dropped_invalid"] + c["dropped_filtered"]
                             + c["dropped_duplicate"] + c["depth"])


@pytest.fixture
def buf(shared_redis, run_name):
    return RedisStreamBuffer(connect(shared_redis.url, 5), run_name)


@pytest.fixture(params=sorted(BUFFERS))
def any_buf(request, shared_redis, run_name):
    """Each backend of the rollout-buffer registry."""
    if request.param == "redis":
        return RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    return open_buffer(None, request.param)


def test_append_read_settle_keeps_the_accounting_identity(any_buf):
    statuses, waiting = any_buf.append_many([inc(i, f"s{i % 2}") for i in range(5)], max_groups=10)
    assert all("-" in s for s in statuses) and waiting == 5
    first = any_buf.read(3, block_ms=100)
    assert [e.payload for e in first] == [b"g0", b"g1", b"g2"] and first[0].group_id == "run/s0/0"
    # delivered entries are not delivered again, but still count as in the buffer
    assert [e.payload for e in any_buf.read(10, block_ms=100)] == [b"g3", b"g4"]
    assert any_buf.depth() == 5 and identity_holds(any_buf.counters())
    records = [(first[0].entry_id, first[0].group_id, "trained", 1),
               (first[1].entry_id, first[1].group_id, "dropped_filtered", 1),
               (first[2].entry_id, first[2].group_id, "dropped_stale", 1)]
    assert any_buf.settle(records) == 3
    assert any_buf.settle(records) == 0  # settling again (a trainer resuming from a checkpoint) counts nothing
    c = any_buf.counters()
    assert (c["ingested"], c["trained"], c["dropped_stale"], c["dropped_filtered"], c["depth"]) == (5, 1, 1, 1, 2)
    assert identity_holds(c)
    assert any_buf.ingested_by_sampler() == {"s0": 3, "s1": 2}
    assert any_buf.read(5, block_ms=50) == []
    with pytest.raises(ValueError, match="unknown outcome 'done'"):
        any_buf.settle([("1-0", "x", "done", 1)])


def test_a_checkpoint_window_of_thousands_settles_in_one_call(buf):
    n = 3000
    buf.append_many([inc(i) for i in range(n)], max_groups=n)
    entries = buf.read(n, 100)
    assert buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in entries]) == n
    c = buf.counters()
    assert c["trained"] == n and c["depth"] == 0 and identity_holds(c)
    assert buf.client.xpending(buf.stream, buf.GROUP)["pending"] == 0


def test_a_resent_group_is_accepted_once(any_buf):
    statuses, _ = any_buf.append_many([inc(0), inc(1)], max_groups=10)
    again, waiting = any_buf.append_many([inc(1), inc(2)], max_groups=10)
    assert again[0] == "dup" and "-" in again[1] and waiting == 3
    c = any_buf.counters()
    assert c["ingested"] == 3 and c["refused_duplicate"] == 1
    assert [e.group_id for e in any_buf.read(10, 100)] == ["run/s0/0", "run/s0/1", "run/s0/2"]


def test_capacity_does_not_count_groups_trained_but_held_for_a_checkpoint(any_buf):
    statuses, waiting = any_buf.append_many([inc(i) for i in range(3)], max_groups=2)
    assert statuses[2] == "full" and waiting == 2 and any_buf.counters()["refused_full"] == 1
    any_buf.read(2, 100)
    assert any_buf.append_many([inc(2)], max_groups=2)[0] == ["full"]  # read, not trained: still waiting
    any_buf.set_held(2)  # trained, acknowledged at the next checkpoint: no longer a backlog
    statuses, waiting = any_buf.append_many([inc(2), inc(3), inc(4)], max_groups=2)
    assert statuses[2] == "full" and waiting == 2 and any_buf.depth() == 4


def test_positions_record_the_highest_accepted_per_sampler(any_buf):
    assert any_buf.data_position("s0") is None
    any_buf.append_many([inc(0), inc(5), inc(3), inc(9, "s1")], max_groups=10)
    assert any_buf.data_position("s0") == 5 and any_buf.data_position("s1") == 9


def test_unanswered_positions_are_those_below_the_highest_with_no_accepted_group(shared_redis, run_name):
    """What a restarted sampler generates first: groups end out of order, so positions it had in flight or unsent
    when it stopped lie below ones accepted after them (they were skipped for good before)."""
    for buffer in (RedisStreamBuffer(connect(shared_redis.url, 5), run_name), open_buffer(None, "memory")):
        def group(position, sampler="s0"):  # a group id as samplers write it: <run>/<sampler>/<position>
            return Incoming(f"{run_name}/{sampler}/{position}", sampler, 0, position, b"g")
        buffer.append_many([group(p) for p in (0, 1, 2, 5, 7)] + [group(3, "s1"), group(4, "s1")], max_groups=100)
        assert buffer.data_position("s0") == 7
        assert buffer.unanswered_positions("s0", 7, 4096) == [3, 4, 6]  # s1's positions are s1's
        assert buffer.unanswered_positions("s0", 7, 2) == [6]  # only the window below the highest
        assert buffer.unanswered_positions("s1", 4, 4096) == [0, 1, 2]
        buffer.append_many([group(4)], max_groups=100)  # a late one arrives: answered now
        assert buffer.unanswered_positions("s0", 7, 4096) == [3, 6]


def test_a_second_copy_that_reaches_the_trainer_is_dropped_not_trained(buf):
    buf.append_many([inc(0)], 10)
    (entry,) = buf.read(1, 100)
    buf.settle([(entry.entry_id, entry.group_id, "trained", 1)])
    # a copy written past the ingest's de-duplication (e.g. by another tool) under the same group id
    buf.client.xadd(buf.stream, {"g": b"g0", "id": entry.group_id})
    buf.client.hincrby(buf.k["counters"], "ingested", 1)
    assert buf.read(10, 100) == []
    c = buf.counters()
    assert c["dropped_duplicate"] == 1 and c["trained"] == 1 and identity_holds(c)


def test_runs_are_namespaced(shared_redis, run_name):
    client = connect(shared_redis.url, 5)
    a, b = RedisStreamBuffer(client, f"{run_name}-a"), RedisStreamBuffer(client, f"{run_name}-b")
    a.append_many([inc(0)], 10)
    assert b.depth() == 0 and b.read(10, 50) == []


def test_unreachable_redis_is_reported(redis_server):
    buf = RedisStreamBuffer(connect(redis_server.url, 5), "t")
    redis_server.stop()
    with pytest.raises(BufferUnavailable):
        buf.append_many([inc(0)], 10)


def test_a_restarted_trainer_takes_back_what_its_predecessor_read_but_never_settled(shared_redis, run_name):
    first = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    first.append_many([inc(i) for i in range(6)], max_groups=6)
    taken = first.read(4, block_ms=100)
    first.settle([(taken[0].entry_id, taken[0].group_id, "trained", 1)])
    # the trainer process dies holding g1..g3: a new one (same consumer) gets them first, each once, then the rest
    second = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    got = [e.payload for e in second.read(2, block_ms=100)] + [e.payload for e in second.read(2, block_ms=100)]
    got += [e.payload for e in second.read(10, block_ms=100)]
    assert got == [b"g1", b"g2", b"g3", b"g4", b"g5"]
    assert second.read(10, block_ms=50) == []
    assert second.depth() == 5 and identity_holds(second.counters())


def test_a_restarted_trainer_reads_past_entries_deleted_while_pending(shared_redis, run_name):
    first = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    first.append_many([inc(i) for i in range(6)], max_groups=6)
    taken = first.read(4, block_ms=100)
    first.client.xdel(first.stream, taken[0].entry_id, taken[1].entry_id)  # e.g. an operator's XDEL
    second = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    second.PENDING_CHECK_S = 3600.0  # the order of the recovery itself, not the check for lost replies
    got = [e.payload for _ in range(4) for e in second.read(2, block_ms=100)]
    assert got == [b"g2", b"g3", b"g4", b"g5"]


def test_entries_whose_read_reply_was_lost_come_back_once(shared_redis, run_name):
    """Redis carried out a read but its reply never arrived (the server killed mid-reply, then redis-py retried
    the read): the entries are pending for the trainer's consumer and count in the depth admission control reads,
    yet no new read returns them, so a run near its last step waited forever. The buffer takes them back when
    nothing new comes, and never returns twice what it already holds."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    buf.PENDING_CHECK_S = 0.0
    buf.append_many([inc(i) for i in range(6)], max_groups=6)
    held = buf.read(2, block_ms=100)  # g0, g1: trained, held until a checkpoint
    lost = buf.client.xreadgroup(buf.GROUP, buf.consumer, {buf.stream: ">"}, count=3)  # g2..g4, reply lost
    assert len(lost[0][1]) == 3
    back = buf.read(10, block_ms=50)  # before g5: they are older
    assert [e.payload for e in back] == [b"g2", b"g3", b"g4"]
    assert [e.payload for e in buf.read(10, block_ms=50)] == [b"g5"]
    assert buf.read(10, block_ms=50) == []
    # once settled they are gone for good: nothing is pending that the trainer does not know
    everything = held + back
    assert buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in everything]) == 5
    assert buf.read(10, block_ms=50) == [] and buf.depth() == 1 and identity_holds(buf.counters())


def test_entries_whose_read_reply_was_lost_come_back_while_new_groups_keep_arriving(shared_redis, run_name):
    """Samplers faster than the trainer keep the stream fed, so no read comes back empty: the entries of a lost
    reply were taken back only then, and so waited (counted against admission, and holding back their sampler's
    audit compaction) for the rest of the run. They come back at the next check, a few at a time, oldest first."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    buf.PENDING_CHECK_S = 0.0
    buf.append_many([inc(i) for i in range(4)], max_groups=100)
    assert [e.payload for e in buf.read(1, block_ms=50)] == [b"g0"]
    buf.client.xreadgroup(buf.GROUP, buf.consumer, {buf.stream: ">"}, count=2)  # g1, g2: the reply lost
    got = []
    for i in range(4, 8):  # a new group before every read
        buf.append_many([inc(i)], max_groups=100)
        got += [e.payload for e in buf.read(1, block_ms=50)]
    assert got == [b"g1", b"g2", b"g3", b"g4"]


def test_entries_of_a_read_whose_duplicate_check_failed_come_back(shared_redis, run_name):
    """Redis answered the read, then failed the duplicate check that follows it (a blip, a LOADING reply): the read
    raises, and the entries Redis delivered must come back later rather than stay pending and counted against the
    samplers' admission until the trainer restarts."""
    import redis

    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    buf.PENDING_CHECK_S = 0.0
    buf.append_many([inc(i) for i in range(3)], max_groups=3)
    check, failed = buf.client.hmget, []

    def fails_once(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise redis.ConnectionError("connection reset by peer (injected)")
        return check(*args, **kwargs)

    buf.client.hmget = fails_once
    with pytest.raises(BufferUnavailable):
        buf.read(10, block_ms=50)
    back = buf.read(10, block_ms=50)
    assert [e.payload for e in back] == [b"g0", b"g1", b"g2"] and buf.read(10, block_ms=50) == []
    assert buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in back]) == 3
    assert buf.depth() == 0 and identity_holds(buf.counters())


def test_an_entry_whose_group_id_is_damaged_is_read_not_fatal(buf):
    """Bytes in Redis that are not UTF-8 must not fail every read (the trainer would stop at each restart): the
    entry is returned, and the trainer's check of its payload refuses it."""
    buf.append_many([inc(0)], max_groups=3)
    buf.client.xadd(buf.stream, {"g": b"damaged", "id": b"\xffrun/s0/1"})
    assert [(e.group_id, e.payload) for e in buf.read(10, block_ms=50)] == [("run/s0/0", b"g0"),
                                                                          ("\ufffdrun/s0/1", b"damaged")]


def test_accepted_groups_survive_a_redis_crash(tmp_path):
    """AOF with fsync on every write: what append_many acknowledged is there after kill -9 and a restart."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    try:
        buf = RedisStreamBuffer(connect(server.url, 5), "crash")
        buf.append_many([inc(i) for i in range(50)], max_groups=100)
        server.kill()
        server = EmbeddedRedis(port=server.port, data_dir=tmp_path / "redis").start()
        again = RedisStreamBuffer(connect(server.url, 5), "crash")
        assert again.counters()["ingested"] == 50 and again.depth() == 50
        assert again.append_many([inc(49), inc(50)], 100)[0][0] == "dup"  # the de-duplication set survived too
    finally:
        server.stop()


def test_connect_fails_fast_on_what_waiting_cannot_fix(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisConnectError, match=r"redis.url=redis://127.0.0.1:\d+/0: not reachable after"):
        connect(url, timeout_s=0.5)
    with pytest.raises(RedisConnectError, match="not a redis:// URL"):
        connect("http://x", 0.5)
    secured = EmbeddedRedis(data_dir=tmp_path / "r")
    secured.start()
    try:
        connect(secured.url, 5).config_set("requirepass", "s3cret")
        for url in (f"redis://:wrong@127.0.0.1:{secured.port}/0", secured.url):
            with pytest.raises(RedisConnectError, match=r"redis.url=.*authentication failed.*right password"):
                connect(url, timeout_s=None)  # would wait for ever if it retried
        with pytest.raises(RedisConnectError, match="no such database"):
            connect(f"redis://:s3cret@127.0.0.1:{secured.port}/99", timeout_s=None)
        assert connect(f"redis://:s3cret@127.0.0.1:{secured.port}/0", 5).ping()
    finally:
        secured.stop()


def test_lineage_keeps_only_the_steps_the_final_model_went_through():
    trainers = [{"epoch": "a", "from_step": "0", "from_epoch": ""}, {"epoch": "b", "from_step": "2", "from_epoch": "a"},
                {"epoch": "c", "from_step": "3", "from_epoch": "b"}]
    steps = [{"epoch": e, "step": str(s), "groups": f'["{e}{s}"]'} for e, s in
             [("a", 1), ("a", 2), ("a", 3), ("b", 3), ("b", 4), ("c", 4), ("c", 5), ("c", 6)]]
    checkpoints = [{"epoch": "a", "step": "2"}, {"epoch": "b", "step": "3"}, {"epoch": "c", "step": "5"}]
    history, final = lineage(trainers, steps, checkpoints)
    assert final == 5 and history == {1: ["a1"], 2: ["a2"], 3: ["b3"], 4: ["c4"], 5: ["c5"]}


def test_audit_counts_trained_dropped_waiting_lost_and_twice(buf, run_name):
    buf.append_many([inc(i) for i in range(6)], 10)
    e = buf.read(6, 100)
    buf.log_trainer("a", 0, "")
    buf.log_step("a", 1, [e[0].group_id, e[1].group_id])
    buf.settle([(e[2].entry_id, e[2].group_id, "dropped_stale", 1)])
    buf.log_checkpoint("a", 1)
    buf.settle([(x.entry_id, x.group_id, "trained", 1) for x in e[:2]])
    report = build_audit(buf.client, run_name)
    assert (report["groups_accepted"], report["groups_trained"], report["groups_dropped"]["dropped_stale"],
            report["groups_waiting"], report["groups_lost"], report["ok"]) == (6, 2, 1, 3, 0, True)
    # a step that trains group 0 again, and a group deleted without a record: the audit says so
    buf.log_step("a", 2, [e[0].group_id, e[3].group_id])
    buf.log_checkpoint("a", 2)
    buf.client.xdel(buf.stream, e[4].entry_id)
    report = build_audit(buf.client, run_name)
    assert report["groups_trained_twice"] == 1 and report["trained_twice_ids"] == [e[0].group_id]
    assert report["groups_lost"] == 1 and report["lost_ids"] == [e[4].group_id] and not report["ok"]


def test_entries_of_a_read_whose_duplicate_settle_failed_come_back(shared_redis, run_name):
    """A read whose batch holds a second copy settles that copy before returning; when that settle fails (a blip)
    the read raises, and the fresh groups of the same read must come back later, not stay pending and unreturned
    (counted against admission) until the trainer restarts."""
    import redis

    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    buf.PENDING_CHECK_S = 0.0
    buf.append_many([inc(0)], max_groups=10)
    (first,) = buf.read(1, block_ms=50)
    buf.settle([(first.entry_id, first.group_id, "trained", 1)])
    buf.client.xadd(buf.stream, {"g": b"g0", "id": first.group_id})  # a second copy past the de-duplication
    buf.client.hincrby(buf.k["counters"], "ingested", 1)
    buf.append_many([inc(1), inc(2)], max_groups=10)
    settle, failed = buf._settle, []

    def fails_once(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise redis.ConnectionError("connection reset by peer (injected)")
        return settle(*args, **kwargs)

    buf._settle = fails_once
    with pytest.raises(BufferUnavailable):
        buf.read(10, block_ms=50)
    back = [e.payload for _ in range(3) for e in buf.read(10, block_ms=50)]
    assert back == [b"g1", b"g2"]
    counters = buf.counters()
    assert counters["dropped_duplicate"] == 1 and counters["depth"] == 2 and identity_holds(counters)


def test_waiting_is_never_negative_on_either_backend(any_buf):
    """A held count above the depth (a dead trainer's, before its successor resets it) reads as nothing waiting,
    on Redis and in memory alike: admission control compares it with its limits."""
    any_buf.append_many([inc(0)], max_groups=10)
    any_buf.set_held(5)
    assert any_buf.admission_state().waiting == 0


def test_an_answer_to_a_prompt_without_a_client_is_appended_whole(buf):
    """An injected prompt's hash without its `client` field (written by an older version, or by hand): the append
    script failed after its XADD (Redis does not roll a script back), leaving an entry no counter knows."""
    buf.client.hset(f"{buf.base}:prompt:p1", mapping={"state": "claimed", "train": "1"})
    statuses, waiting = buf.append_many([Incoming("run/inj/p1", "s0", 0, -1, b"answer", injected_prompt="p1")], 10)
    assert statuses[0] not in ("unknown", "dup", "full") and waiting == 1
    assert identity_holds(buf.counters()) and buf.counters()["ingested"] == 1
    assert buf.client.hget(f"{buf.base}:prompt:p1", "state") == b"done"


def test_a_damaged_compaction_watermark_refuses_the_batch_naming_the_field_and_writes_nothing(buf):
    """`below:<sampler>` is how the ingest refuses second copies of compacted groups: one that is no number must
    stop appends for that sampler with an error that names it, before any group of the batch is written."""
    import redis

    buf.client.hset(buf.k["audit:compacted"], "below:s0", "x")
    with pytest.raises(redis.ResponseError, match=r"audit:compacted field below:s0 .*not a data position.*HSET"):
        buf.append_many([inc(0, sampler="s1"), inc(1, sampler="s0")], max_groups=10)
    assert buf.depth() == 0 and buf.counters()["ingested"] == 0
    assert buf.append_many([inc(2, sampler="s1")], max_groups=10)[1] == 1  # other samplers go on


def test_the_highest_valid_data_position_round_trips_through_the_buffer_exactly(buf):
    """wire.MAX_DATA_POSITION is what the append script records exactly: the accepted record compaction reads (cjson
    keeps 14 significant digits) and the resume position GetDataPosition reads (a Lua number written by HSET)."""
    from grpo_stream.common.rollouts.audit_trail import read_trail
    from grpo_stream.common.rollouts.wire import MAX_DATA_POSITION

    buf.append_many([inc(MAX_DATA_POSITION)], max_groups=10)
    trail = read_trail(buf.client, buf.k)
    assert trail["damaged"] == [] and trail["accepted"][f"run/s0/{MAX_DATA_POSITION}"]["position"] == MAX_DATA_POSITION
    assert buf.data_position("s0") == MAX_DATA_POSITION
