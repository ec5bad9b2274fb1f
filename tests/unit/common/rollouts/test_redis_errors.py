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
