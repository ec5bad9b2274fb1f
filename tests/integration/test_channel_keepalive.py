"""A client's call to a server that froze (SIGSTOP: its connection stays open, nothing answers) ends, however long
the call sat quiet before: CHANNEL_OPTIONS' keepalive, on real gRPC over loopback, its periods scaled down to 0.5 s
(a stand-in for 20 s) so the test takes seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc

from grpo_stream.common.rpc import grpc_util
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc

# a PromptService whose StreamResults sends nothing until the call ends; its server tolerates the scaled-down pings
CHILD = """
import time
from grpo_stream.common.rpc import grpc_util
from grpo_stream.protos import prompts_pb2_grpc
grpc_util.SERVER_OPTIONS[:] = [(k, 100 if k == "grpc.http2.min_ping_interval_without_data_ms" else v)
                               for k, v in grpc_util.SERVER_OPTIONS]

class Quiet(prompts_pb2_grpc.PromptServiceServicer):
    def StreamResults(self, request, context):
        while context.is_active():
            time.sleep(0.1)
        yield from ()

server = grpc_util.new_server(None)
prompts_pb2_grpc.add_PromptServiceServicer_to_server(Quiet(), server)
print(grpc_util.bind(server, "127.0.0.1", 0, None, "test.port"), flush=True)
server.start()
server.wait_for_termination()
"""

SCALE = {"grpc.keepalive_time_ms": 500, "grpc.keepalive_timeout_ms": 1000, "grpc.http2.ping_timeout_ms": 1000}


def test_a_stream_quiet_for_many_ping_periods_still_notices_a_frozen_server(monkeypatch):
    """grpc sends at most 2 pings while no data goes out unless told otherwise, and gives up on an unanswered one
    after ping_timeout_ms (60 s), not keepalive_timeout_ms: a results follower that waited quietly for more than
    two ping periods then stopped pinging, and waited forever on a server host that vanished."""
    # only the periods change: which settings there are is what is under test
    monkeypatch.setattr(grpc_util, "CHANNEL_OPTIONS", [(k, SCALE.get(k, v)) for k, v in grpc_util.CHANNEL_OPTIONS])
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    channel = None
    try:
        port = int(child.stdout.readline())
        channel = grpc_util.open_channel(f"127.0.0.1:{port}", None)
        call = prompts_pb2_grpc.PromptServiceStub(channel).StreamResults(
            prompts_pb2.ResultsRequest(prompt_ids=["p-1"], follow=True))
        ended = []
        reader = threading.Thread(target=lambda: ended.append(_end_of(call)), daemon=True)
        reader.start()
        time.sleep(3.0)  # six ping periods with no data either way
        assert not ended, f"the quiet stream ended before the server froze: {ended}"
        os.kill(child.pid, signal.SIGSTOP)
        reader.join(20)
        assert ended == [grpc.StatusCode.UNAVAILABLE], "the call to a frozen server never ended"
    finally:
        child.kill()
        child.wait()
        if channel is not None:
            channel.close()


def _end_of(call) -> grpc.StatusCode | None:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return None
