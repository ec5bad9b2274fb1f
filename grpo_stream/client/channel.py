"""The prompt client's channel: one that finds a server coming (back) up within the caller's wait.

A gRPC channel whose connect failed tries again only after its reconnect back-off, which grows 1.6x per failure up
to 120 s, and a new channel to the same address shares it (one subchannel per address in the process) while the old
one is open. So a client that waited a minute for a trainer still starting, or restarted, found it tens of seconds
after it was up: `submit --wait 60` or a follow failed at 60 s with the server answering since 50 s. Here a wait
replaces a channel that failed to connect by a new one every REOPEN_S, and one gone idle (its server went away) at
once, closing the old first; a channel still connecting (a slow TLS handshake) is left to finish.

Closing a channel while gRPC's connectivity poller (the thread behind `subscribe`, waking every 0.2 s) may still
look at it kills that thread with "Channel closed!" on stderr. So a channel is watched by one subscription at most,
made by the first wait (a client closed before any call has none), and closed POLL_GRACE_S after it ends.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import grpc

from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.protos import prompts_pb2_grpc

REOPEN_S = 1.0  # how often a wait looks for a server that is not up on a new channel
POLL_GRACE_S = 0.5  # from a subscription's end until the poller is gone (two of its 0.2 s looks, and slack)


class _Connectivity:
    """A channel's connectivity state as it changes, from subscribing (which starts its connect) until close()."""

    def __init__(self, channel: grpc.Channel):
        self.channel, self.state, self.started = channel, None, False
        self._changed = threading.Condition()
        channel.subscribe(self._seen, try_to_connect=True)

    def _seen(self, state: grpc.ChannelConnectivity) -> None:
        with self._changed:
            self.state = state
            self.started |= state != grpc.ChannelConnectivity.IDLE
            self._changed.notify_all()

    def wait_ready(self, seconds: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.state == grpc.ChannelConnectivity.READY, max(0.0, seconds))

    @property
    def failed(self) -> bool:
        """Failed to connect: gRPC tries again only after its back-off."""
        return self.state == grpc.ChannelConnectivity.TRANSIENT_FAILURE

    @property
    def gone_idle(self) -> bool:
        """Connected (or tried), then idle (the server went away): nothing asks it to connect again."""
        return self.started and self.state == grpc.ChannelConnectivity.IDLE

    def close(self) -> None:
        self.channel.unsubscribe(self._seen)


class PromptChannel:
    """A channel to the PromptService at `address_of()` (asked again at each new channel: a run `up` restarted
    serves on new ports) and its stub; `wait_ready` replaces it while no server answers (module doc)."""

    def __init__(self, address_of: Callable[[], str], security: ClientSecurity | None):
        self._address_of, self.security = address_of, security
        self._open()

    def _open(self) -> None:
        self.address = self._address_of()
        self.channel = open_channel(self.address, self.security)
        self.stub = prompts_pb2_grpc.PromptServiceStub(self.channel)
        self._watch: _Connectivity | None = None

    def wait_ready(self, within_s: float) -> bool:
        """Wait up to `within_s` for the channel to connect (True when it did); a call made after a failed wait
        fails at once."""
        deadline = time.monotonic() + max(0.0, within_s)
        if self._watch is None:
            self._watch = _Connectivity(self.channel)
        while True:
            if self._watch.gone_idle:
                self._replace()
            if self._watch.wait_ready(min(REOPEN_S, deadline - time.monotonic())):
                return True
            if time.monotonic() >= deadline:
                return False
            if self._watch.failed:
                self._replace()

    def _replace(self) -> None:
        self._retire(wait=True)  # closed first: a new channel shares an open one's back-off
        self._open()
        self._watch = _Connectivity(self.channel)

    def close(self) -> None:
        self._retire(wait=False)

    def _retire(self, wait: bool) -> None:
        """Close the channel once its poller is gone: now, after POLL_GRACE_S (`wait`), or on a timer thread."""
        channel, watch = self.channel, self._watch
        if watch is None:
            channel.close()
            return
        watch.close()
        if wait:
            time.sleep(POLL_GRACE_S)
            channel.close()
            return
        closer = threading.Timer(POLL_GRACE_S, channel.close)
        closer.daemon = True  # a process exiting first takes the channel with it
        closer.start()
