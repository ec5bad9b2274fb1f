"""Python client of PromptService: inject prompts into a live run and follow their results.

    client = PromptClient("127.0.0.1:50151", ClientSecurity(token=open("client.token").read().strip()))
    ids = client.submit([{"question": "What is 17 + 25?", "answer": "42", "tags": ["probe"]}])
    for result in client.results(ids):
        print(result.prompt_id, result.policy_version, result.reward_mean)

Prompt dicts use the keys of SPEC_KEYS (`answer` is short for reference_answer). A full queue or quota
(RESOURCE_EXHAUSTED) is retried after the server's retry-after-ms hint, up to `retry_s` seconds (a request over the
gRPC message limit, or of more prompts than the queue or quota holds at all, which never fits, is not). Calls wait
for a server that is still starting up to `timeout_s`: a wait for the channel first (on a new channel each second
while none answers, not at gRPC's growing back-off: channel.py), then unary calls within what is left of it;
streams have no deadline, so no server at the address fails the call instead of waiting forever. `follow` and
`follow_tag` outlive a server restart (a trainer restarted by `up`): they call StreamResults again, each result
yielded once.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Iterable, Iterator

import grpc

from grpo_stream.client.channel import PromptChannel
from grpo_stream.client.errors import is_too_large, never_fits
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc

# how a stream ends when its server goes away (a restart, a dropped connection): a new call may succeed
RECONNECT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                             grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN})

# a results stream that broke after being open this long (or after a result) found its server back: the next break
# gets a whole reconnect window again; one that breaks sooner (a server failing every call) does not, so following
# ends, naming the server's error, reconnect_s after the first of those breaks instead of retrying forever
STREAM_UP_S = 10.0
MIN_RETRY_S = 0.1  # the shortest wait before calling again after a full queue, whatever the server's hint
# prompt ids one StreamResults call may name (the server's MAX_IDS, trainer_service/ingest/prompt_service.py): a
# file of more, all submitted, is followed this many at a time instead of refused as INVALID_ARGUMENT after its submit
FOLLOW_AT_ONCE = 10_000

SPEC_KEYS = ("text", "question", "answer", "reference_answer", "rewards", "num_generations", "priority", "tags",
             "train")


# each key's JSON type: a value of another type is refused, never coerced ("false" is not false, "tag" is no list)
_SPEC_TYPES = {"text": str, "question": str, "answer": (str, int, float), "reference_answer": (str, int, float),
               "rewards": list, "num_generations": int, "priority": int, "tags": list, "train": bool}


def to_spec(item: dict, where: str = "prompt") -> prompts_pb2.PromptSpec:
    """A PromptSpec from a dict; ValueError naming the key for anything unknown or mistyped."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: a prompt is a JSON object, not {type(item).__name__}")
    unknown = sorted(set(item) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(SPEC_KEYS)}")
    if "answer" in item and "reference_answer" in item:  # one field: the other value would be dropped unsaid
        raise ValueError(f"{where}: give `answer` or `reference_answer` (two names of one field), not both")
    if ("text" in item) == ("question" in item):
        raise ValueError(f"{where}: give exactly one of `text` (used as is) or `question` (rendered with the run's "
                         "template)")
    for key, value in item.items():
        wanted = _SPEC_TYPES[key]
        # bool is an int in Python: true is no count, and 1 is no `train`
        if not isinstance(value, wanted) or (isinstance(value, bool) and wanted is not bool):
            names = " or ".join(t.__name__ for t in (wanted if isinstance(wanted, tuple) else (wanted,)))
            raise ValueError(f"{where}.{key}: {value!r} is a {type(value).__name__}; give a {names}")
        if wanted is list and not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}.{key}: give a list of strings")
        _check_value(value, f"{where}.{key}", count=wanted is int)
    try:
        return prompts_pb2.PromptSpec(
            text=item.get("text"), question=item.get("question"),
            reference_answer=str(item.get("reference_answer", item.get("answer", ""))),
            rewards=item.get("rewards", []), num_generations=item.get("num_generations", 0),
            priority=item.get("priority", 0), tags=item.get("tags", []), train=item.get("train", False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


INT32 = (-(1 << 31), (1 << 31) - 1)  # the proto's int32 fields; the server names the allowed range within it


def _check_value(value, at: str, count: bool) -> None:
    """ValueError naming `at` for what protobuf would refuse with a message naming no key (a count past int32, a
    lone surrogate, which JSON's \\ud800 escapes make and UTF-8 cannot hold) or turn into text no reward matches
    (NaN, Infinity). `count`: an int32 field (an answer that is a number is text)."""
    if count and not INT32[0] <= value <= INT32[1]:
        raise ValueError(f"{at}: {value} is outside a 32-bit integer; give a small whole number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{at}: {value!r} is not a finite number; give the answer as text")
    texts = dict(enumerate(value)) if isinstance(value, list) else {None: value}
    for k, text in texts.items():
        try:
            if isinstance(text, str):
                text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{at if k is None else f'{at}[{k}]'}: character {exc.start} is a lone UTF-16 surrogate "
                             "(a \\ud800-\\udfff escape without its pair), which is not text; fix the escape") from None


def retry_after_s(error: grpc.RpcError, default_s: float = 1.0) -> float:
    """The server's retry-after-ms hint in seconds, else `default_s`; at least MIN_RETRY_S (a hint of 0 or less
    would have the client call again in a busy loop)."""
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return max(MIN_RETRY_S, int(value) / 1000)
            except (TypeError, ValueError):
                break
    return default_s


def token_problem(token: str) -> str | None:
    """Why gRPC cannot send `token` as its authorization header (None: it can): a header value is one line of
    printable ASCII. (Sent anyway, the call failed "INTERNAL: Invalid metadata", naming no token source, and a
    follower retried that as a broken stream.)"""
    for k, char in enumerate(token):
        if not " " <= char <= "~":
            what = "a line break" if char in "\r\n" else f"character {char!r}"
            return (f"{what} at character {k + 1}: a token is one line of printable ASCII (as `grpo-stream tokens` "
                    "writes it in <role>.token; not the token table)")
    return None


class PromptClient:
    """One thread's client of PromptService: while a call waits for a server that is down, the client replaces its
    channel (channel.py), which ends calls another thread has open on the old one. `address`: HOST:PORT, or a
    function giving the current one, asked again at each new channel (a run `up` restarted serves on new ports)."""

    def __init__(self, address: str | Callable[[], str], security: ClientSecurity | None = None,
                 timeout_s: float = 30.0):
        if security is not None and security.token and (problem := token_problem(security.token)):
            raise ValueError(f"the client token: {problem}")
        self._conn = PromptChannel(address if callable(address) else (lambda: address), security)
        self.timeout_s = timeout_s

    @property
    def address(self) -> str:
        return self._conn.address

    @property
    def channel(self) -> grpc.Channel:
        return self._conn.channel

    @property
    def stub(self) -> prompts_pb2_grpc.PromptServiceStub:
        return self._conn.stub

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "PromptClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompts: Iterable[dict | prompts_pb2.PromptSpec], retry_s: float = 60.0) -> list[str]:
        """Queue prompts (one Submit call); their ids in order."""
        specs = [p if isinstance(p, prompts_pb2.PromptSpec) else to_spec(p, f"prompts[{i}]")
                 for i, p in enumerate(prompts)]
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return list(self._unary("Submit", prompts_pb2.SubmitRequest(prompts=specs)).prompt_ids)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or is_too_large(exc) or never_fits(exc):
                    raise
                pause = retry_after_s(exc)
                if time.monotonic() + pause > deadline:  # a hint past retry_s (or a huge one) is not slept through
                    raise
                time.sleep(pause)

    def results(self, prompt_ids: list[str] | None = None, tag: str | None = None, follow: bool = True,
                timeout_s: float | None = None) -> Iterator[prompts_pb2.PromptResult]:
        """Each result of `prompt_ids` (ends when all are finished) or of `tag` (with follow: until timeout_s). Waits
        up to the client's timeout_s for a server still starting; UNAVAILABLE when none answers by then."""
        self._wait_ready(self.timeout_s)
        yield from self._stream(prompt_ids, tag, follow, timeout_s)

    def _stream(self, prompt_ids, tag=None, follow=True, timeout_s=None) -> Iterator[prompts_pb2.PromptResult]:
        # no wait_for_ready: a stream has no deadline, and would wait forever for a server that never comes
        request = prompts_pb2.ResultsRequest(prompt_ids=prompt_ids or [], tag=tag or "", follow=follow)
        yield from self.stub.StreamResults(request, timeout=timeout_s)

    def _wait_ready(self, within_s: float) -> bool:
        """Wait up to `within_s` for a server (PromptChannel.wait_ready); True when the channel is up."""
        return self._conn.wait_ready(within_s)

    def _unary(self, method: str, request):
        """`method` called once the channel is up, waiting up to timeout_s in all for a server still starting."""
        deadline = time.monotonic() + self.timeout_s
        self._wait_ready(self.timeout_s)
        return getattr(self.stub, method)(request, timeout=max(0.0, deadline - time.monotonic()), wait_for_ready=True)

    def follow(self, prompt_ids: list[str], reconnect_s: float = 60.0,
               on_reconnect=None) -> Iterator[prompts_pb2.PromptResult]:
        """Each result of `prompt_ids` once, across server restarts (`_resume`); ends when all are finished. More
        than FOLLOW_AT_ONCE ids are followed in calls of that many, in order (one finished early waits for its call)."""
        left = dict.fromkeys(prompt_ids)  # ordered, and a set: thousands of results are not O(n) each

        def take(result) -> bool:
            if result.prompt_id not in left:  # a result already yielded is never repeated
                return False
            del left[result.prompt_id]
            return True

        def each() -> Iterator[prompts_pb2.PromptResult]:
            while left:
                chunk = list(itertools.islice(left, FOLLOW_AT_ONCE))
                yield from self._resume(lambda: [p for p in chunk if p in left], take, reconnect_s, on_reconnect)
                if any(p in left for p in chunk):  # the server ended the call unanswered: no loop calling it again
                    return

        return each()

    def follow_tag(self, tag: str, reconnect_s: float = 60.0,
                   on_reconnect=None) -> Iterator[prompts_pb2.PromptResult]:
        """Each finished result of the caller's prompts tagged `tag`, then each new one, once, across server restarts
        (`_resume`: a new call streams the finished ones again, which are skipped); ends only with an error."""
        seen: set[str] = set()

        def take(result) -> bool:
            new = result.prompt_id not in seen
            seen.add(result.prompt_id)
            return new

        return self._resume(lambda: None, take, reconnect_s, on_reconnect, tag)

    def _resume(self, wanted, take, reconnect_s: float, on_reconnect, tag: str | None = None
                ) -> Iterator[prompts_pb2.PromptResult]:
        """The results of StreamResults for the prompt ids `wanted()` (or `tag`) that `take(result)` accepts, as a
        stream that outlives its server: one that breaks (RECONNECT_CODES) is called again, as soon as the server is
        back, with backoff; the error is raised when no stream has worked (given a result or stayed open STREAM_UP_S)
        within `reconnect_s` seconds of the break (of the start, for the first call). `on_reconnect(error)` is
        called before each new attempt (to say so)."""
        delay, broke_at = 0.5, time.monotonic()
        while tag or wanted():
            self._wait_ready(broke_at + reconnect_s - time.monotonic())
            opened, worked = time.monotonic(), False
            try:
                for result in self._stream(wanted(), tag):
                    worked = True
                    if take(result):
                        yield result
                return
            except grpc.RpcError as exc:
                if exc.code() not in RECONNECT_CODES:
                    raise
                now = time.monotonic()
                if worked or now - opened >= STREAM_UP_S:  # the server was back: a new break, a new window
                    broke_at, delay = now, 0.5
                if now + delay >= broke_at + reconnect_s:
                    raise
                if on_reconnect is not None:
                    on_reconnect(exc)
                time.sleep(delay)  # a server failing at once is not hammered
                delay = min(2 * delay, 5.0)

    def cancel(self, prompt_ids: list[str]) -> prompts_pb2.CancelReply:
        return self._unary("Cancel", prompts_pb2.CancelRequest(prompt_ids=prompt_ids))

    def status(self) -> prompts_pb2.RunStatus:
        return self._unary("GetStatus", prompts_pb2.StatusRequest())
