"""The interceptor every gRPC server runs: who may call (auth.py), and how many calls of each kind it serves at once.

grpcio's sync server serves each call on a pool thread, and a unary call's thread waits, with no deadline of its
own, for a request the peer may never send: a peer that opens calls and sends nothing used to hold every thread of
a server, token or not. So here every method is served as a request-streaming one (a unary method reads its one
request itself), which grpcio starts as soon as the call's headers arrived:
- a refusal (no token, the wrong role, a full kind) is answered at once and never reads the request;
- an admitted call takes a slot of its kind (KIND_BY_METHOD) and one of its caller's within that kind, and gives
  them back when the call ends, however it ends (a context callback), so prompt clients and bulk weight fetches
  cannot take the threads rollout ingest needs, and one token cannot take a whole kind;
- a unary call whose request has not arrived within rpc.first_message_timeout_s is cancelled.
The pool holds every kind's slots plus REFUSAL_THREADS, and grpc's `maximum_concurrent_rpcs` is the pool's size:
beyond it a call is answered RESOURCE_EXHAUSTED at once instead of queueing behind held threads.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from typing import Callable

import grpc

from grpo_stream.common.rpc.auth import Caller, TokenTable, bearer, caller_refusal

log = logging.getLogger(__name__)

# Kinds of calls, each with its own slots. A method missing here counts as "ops" (health, reflection and anything
# a test server registers); tests/integration/test_call_limits.py checks that every RPC of ROLES_BY_METHOD has one.
SAMPLER, WEIGHT_FETCH, PROMPT, FOLLOWER, OPS = "sampler", "weight_fetch", "prompt", "follower", "ops"
PROBE = "probe"  # health Check and List: answered at once, so a held Watch stream (an ops call) cannot refuse them
KIND_BY_METHOD: dict[str, str] = {
    "/grpc.health.v1.Health/Check": PROBE, "/grpc.health.v1.Health/List": PROBE,
    **{f"/grpo_stream.v1.RolloutIngest/{m}": SAMPLER for m in
       ("StreamBatches", "PushGroup", "GetDataPosition", "ClaimPrompts", "Admit")},
    "/grpo_stream.v1.WeightService/GetManifest": SAMPLER,
    "/grpo_stream.v1.WeightService/ReportVersion": SAMPLER,
    "/grpo_stream.v1.WeightService/FetchSlices": WEIGHT_FETCH,
    **{f"/grpo_stream.v1.PromptService/{m}": PROMPT for m in ("Submit", "Cancel", "GetStatus")},
    "/grpo_stream.v1.PromptService/StreamResults": FOLLOWER,
}
SETTING_BY_KIND = {SAMPLER: "rpc.sampler_calls", WEIGHT_FETCH: "rpc.weight_fetches", PROMPT: "rpc.prompt_calls",
                   FOLLOWER: "prompts.max_followers", OPS: "rpc.ops_calls", PROBE: "rpc.ops_calls"}
REFUSAL_THREADS = 16  # pool threads beyond every kind's slots: refusals are answered on them, at once


def kind_of(method: str) -> str:
    return KIND_BY_METHOD.get(method, OPS)


@dataclasses.dataclass(frozen=True)
class CallLimits:
    """Calls open at once on one server, per kind and per caller (config sections rpc and prompts)."""

    per_kind: dict[str, int] = dataclasses.field(default_factory=lambda: {
        SAMPLER: 256, WEIGHT_FETCH: 64, PROMPT: 32, FOLLOWER: 128, OPS: 16, PROBE: 16})
    per_caller: int = 32
    first_message_timeout_s: float = 30.0
    streams_per_connection: int = 128

    @classmethod
    def from_config(cls, cfg) -> "CallLimits":
        rpc = cfg.rpc
        return cls({SAMPLER: rpc.sampler_calls, WEIGHT_FETCH: rpc.weight_fetches, PROMPT: rpc.prompt_calls,
                    FOLLOWER: cfg.prompts.max_followers, OPS: rpc.ops_calls, PROBE: rpc.ops_calls}, rpc.calls_per_caller,
                   rpc.first_message_timeout_s, rpc.streams_per_connection)

    def caller_share(self, kind: str) -> int:
        """Calls one caller may hold of `kind`: rpc.calls_per_caller, and at most half the kind's slots (one token
        cannot take a whole kind whatever the two settings say)."""
        return min(self.per_caller, max(1, self.per_kind[kind] // 2))

    @property
    def workers(self) -> int:
        """The server's pool: every kind's slots, plus threads that answer refusals."""
        return sum(self.per_kind.values()) + REFUSAL_THREADS


class CallGate:
    """Counts the calls open per kind and per (kind, caller); admits a call or says at once why not."""

    def __init__(self, limits: CallLimits):
        self.limits = limits
        self._lock = threading.Lock()
        self._open: collections.Counter = collections.Counter()

    def enter(self, kind: str, caller: str | None) -> str | None:
        """Take a slot of `kind` for `caller` (None: no identity, auth.mode=none or an open health probe); None
        when taken, else why not (for RESOURCE_EXHAUSTED)."""
        limit, per_caller = self.limits.per_kind[kind], self.limits.caller_share(kind)
        with self._lock:
            if self._open[kind] >= limit:
                return (f"this server already serves {limit} {kind} calls ({SETTING_BY_KIND[kind]}); retry later, or "
                        "raise it")
            if caller is not None and self._open[kind, caller] >= per_caller:
                return (f"{caller} already has {per_caller} {kind} calls open (rpc.calls_per_caller, at most half "
                        f"of {SETTING_BY_KIND[kind]}); finish some first, or give each process its own token")
            self._open[kind] += 1
            if caller is not None:
                self._open[kind, caller] += 1
        return None

    def leave(self, kind: str, caller: str | None) -> None:
        with self._lock:
            self._open[kind] -= 1
            if caller is not None:
                self._open[kind, caller] -= 1
                if not self._open[kind, caller]:
                    del self._open[kind, caller]

    def open_calls(self, kind: str, caller: str | None = None) -> int:
        with self._lock:
            return self._open[kind] if caller is None else self._open[kind, caller]


class Watchdog:
    """Runs a callback at a deadline unless disarmed first: one thread for all of a server's calls, started on
    demand and ended after LINGER_S with nothing to watch (no thread per call, none left behind by a stopped
    server)."""

    LINGER_S = 5.0

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[list] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, callback: Callable[[], None]) -> list:
        entry = [time.monotonic() + seconds, next(self._seq), callback]
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rpc-first-message", daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:
                self._cond.notify()
        return entry

    def disarm(self, entry: list) -> None:
        with self._cond:
            entry[2] = None  # dropped when it comes to the top

    def _run(self) -> None:
        while True:
            due = []
            with self._cond:
                now = time.monotonic()
                while self._heap and (self._heap[0][2] is None or self._heap[0][0] <= now):
                    entry = heapq.heappop(self._heap)
                    if entry[2] is not None:
                        due.append(entry[2])
                if not due:
                    if not self._heap and not self._cond.wait(self.LINGER_S) and not self._heap:
                        self._thread = None
                        return
                    if self._heap:
                        self._cond.wait(max(0.0, self._heap[0][0] - time.monotonic()))
                    continue
            for callback in due:  # outside the lock: cancelling a call may take grpc's locks
                try:
                    callback()
                except Exception:  # noqa: BLE001 - one call's cancellation must not stop the watchdog
                    log.exception("cancelling a call whose request never came failed")


def refusal_handler(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """Answers `code` as soon as the call's headers arrived: request-streaming, so grpcio runs it without waiting
    for a request, and it never reads one (a unary-shaped refusal would wait for the whole request first)."""

    def deny(_requests, context):
        context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(deny)


_NOTHING = object()


class GuardInterceptor(grpc.ServerInterceptor):
    """Auth (UNAUTHENTICATED without a known token, PERMISSION_DENIED for a role the RPC does not accept; none when
    `table` is None), then the limits of `limits` (RESOURCE_EXHAUSTED when a kind or the caller's share is full)."""

    def __init__(self, table: TokenTable | None, limits: CallLimits, open_health: bool = False):
        self.table, self.open_health = table, open_health
        self.gate, self.watchdog = CallGate(limits), Watchdog()
        self.first_message_s = limits.first_message_timeout_s

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED, answered by grpcio at once
        method, caller = handler_call_details.method, None
        # open health is the probes' unary calls: a Watch stream never ends, and without a token nothing bounds
        # how many one peer holds
        if self.table is not None and not (self.open_health and kind_of(method) == PROBE):
            token = bearer(handler_call_details.invocation_metadata)
            found = self.table.lookup(token) if token else None
            refused = caller_refusal(found, method)
            if refused is not None:
                return refusal_handler(*refused)
            caller = found
        return self._guarded(handler, method, kind_of(method), caller)

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str, kind: str, caller: Caller | None
                 ) -> grpc.RpcMethodHandler:
        """`handler` served request-streaming, holding a slot of `kind` from its start to its end."""
        name = None if caller is None else caller.name
        behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        gate, watchdog, first_message_s = self.gate, self.watchdog, self.first_message_s

        def admit(context) -> None:
            refused = gate.enter(kind, name)
            if refused is not None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            if not context.add_callback(lambda: gate.leave(kind, name)):  # the call already ended
                gate.leave(kind, name)
                context.abort(grpc.StatusCode.CANCELLED, "the call ended before it started")

        def one_request(requests, context):
            timer = watchdog.arm(first_message_s, context.cancel)
            try:
                request = next(requests, _NOTHING)
            finally:
                watchdog.disarm(timer)
            if request is _NOTHING:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes exactly one request message; the "
                              "call ended without one")
            return request

        def serve(requests, context):
            admit(context)
            return behavior(requests if handler.request_streaming else one_request(requests, context), context)

        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
            grpc.stream_unary_rpc_method_handler
        return make(serve, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
