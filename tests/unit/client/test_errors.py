"""How the client commands word a RESOURCE_EXHAUSTED: a full queue or quota, or the server's call limits."""

import grpc

from grpo_stream.client.errors import explain
from grpo_stream.common.rpc.call_guard import FOLLOWER, CallGate, CallLimits


class Refused(grpc.RpcError):
    def __init__(self, details: str):
        self._details = details

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return self._details


def test_a_full_follower_limit_is_not_called_a_full_queue():
    """`results --follow` refused by prompts.max_followers said the prompt queue or quota was full and to cancel
    unfinished prompts, neither of which was so or would help."""
    gate = CallGate(CallLimits(per_kind={FOLLOWER: 1}, per_caller=32))
    assert gate.enter(FOLLOWER, "someone") is None
    error = explain(Refused(gate.enter(FOLLOWER, "client")), "127.0.0.1:1")
    assert "prompts.max_followers" in str(error) and "retry later" in str(error)
    assert "queue" not in str(error) and "unfinished prompts" not in str(error)


def test_a_full_quota_still_says_so():
    details = "client 'client' has 20 unfinished prompts (prompts.max_pending_per_client=20); 5 more exceed it"
    error = explain(Refused(details), "127.0.0.1:1")
    assert "quota of unfinished prompts is full" in str(error) and details in str(error)
