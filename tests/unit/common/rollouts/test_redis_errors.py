"""One rule for which Redis failures pass (back off and retry) and which are real faults, including the forms an
error takes when a command inside a Lua script fails (the code then sits in the text, not in the class)."""

import pytest
import redis
import redis.exceptions as rx

from grpo_stream.common.rollouts.redis_errors import BufferUnavailable, is_unavailable, redis_call

SCRIPT = "Error running script (call to f_0123): @user_script:12: "


@pytest.mark.parametrize("exc", [
    redis.ConnectionError("Connection refused"), redis.TimeoutError("Timeout reading from socket"),
    rx.BusyLoadingError("Redis is loading the dataset in memory"),
    rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    rx.ReadOnlyError("You can't write against a read only replica."),
    rx.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    redis.ResponseError(SCRIPT + "-OOM command not allowed when used memory > 'maxmemory'."),
    redis.ResponseError(SCRIPT + "-LOADING Redis is loading the dataset in memory"),
    redis.ResponseError(SCRIPT + "-READONLY You can't write against a read only replica."),
    redis.ResponseError("MASTERDOWN Link with MASTER is down"),
])
def test_passing_failures_are_unavailable(exc):
    assert is_unavailable(exc)

    def fail():
        raise exc
    with pytest.raises(BufferUnavailable, match="redis: "):
        redis_call(fail)


@pytest.mark.parametrize("exc", [
    redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    redis.ResponseError(SCRIPT + "attempt to compare nil with number"),
    rx.NoScriptError("No matching script."), rx.AuthenticationError("invalid password"),
    redis.ResponseError("ERR unknown command 'XADDD'"), ValueError("not Redis at all"),
])
def test_real_faults_propagate(exc):
    assert not is_unavailable(exc)

    def fail():
        raise exc
    with pytest.raises(type(exc)):
        redis_call(fail)


@pytest.mark.parametrize("run", ["OOM-repro", "LOADING", "a.READONLY", "MASTERDOWN_2"])
def test_a_damaged_record_in_a_run_named_like_a_code_is_a_fault_not_a_passing_failure(run):
    """Run names may hold these words ([A-Za-z0-9_.-]), and a damaged record's message names its key: the code was
    matched anywhere after a ':' or '-', so the ingest answered UNAVAILABLE and the trainer retried for ever (a
    damaged fence: 'Redis unavailable' at every try, never the LeaseDamaged that names the key)."""
    for message in (f"DAMAGEDBUFFER grpo-stream:{run}:counters field ingested holds \"x\", not an integer",
                    f"DAMAGEDBUFFER grpo-stream:{run}:trainer:fence holds \"x\", not a fencing number",
                    f"DAMAGEDBUFFER grpo-stream:r:positions field s-{run} holds \"x\", not an integer"):
        assert not is_unavailable(redis.ResponseError(message)), message


@pytest.mark.parametrize("message", [
    "OOM command not allowed when used memory > 'maxmemory'. script: 219bb3, on @user_script:1.",
    "Command # 1 (EVALSHA 219bb3 2 k) of pipeline caused error: OOM command not allowed when used memory",
])
def test_a_code_where_redis_puts_it_still_passes(message):
    assert is_unavailable(redis.ResponseError(message))
