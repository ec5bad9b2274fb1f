"""Python client of PromptService: inject prompts into a live run and follow their results.

    client = PromptClient("127.0.0.1:50151", ClientSecurity(token=open("client.token").read().strip()))
    ids = client.submit([{"question": "What is 17 + 25?", "answer": "42", "tags": ["probe"]}])
    for result in client.results(ids):
        print(result.prompt_id, result.policy_version, result.reward_mean)

Prompt dicts use the keys of SPEC_KEYS (`answer` is short for reference_answer). A full queue or quota
(RESOURCE_EXHAUSTED) is retried after the server's retry-after-ms hint, up to `retry_s` seconds. Calls wait for a
server that is still starting (gRPC wait_for_ready) up to their deadline. `follow` outlives a server restart (a
trainer restarted by `up`): it calls StreamResults again for the prompts not yet answered.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import grpc

from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc

# how a stream ends when its server goes away (a restart, a dropped connection): a new call may succeed
RECONNECT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                             grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN})

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
    try:
        return prompts_pb2.PromptSpec(
            text=item.get("text"), question=item.get("question"),
            reference_answer=str(item.get("reference_answer", item.get("answer", ""))),
            rewards=item.get("rewards", []), num_generations=item.get("num_generations", 0),
            priority=item.get("priority", 0), tags=item.get("tags", []), train=item.get("train", False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def retry_after_s(error: grpc.RpcError, default_s: float = 1.0) -> float:
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms":
            try:
                return int(value) / 1000
            except ValueError:
                break
    return default_s


class PromptClient:
    def __init__(self, address: str, security: ClientSecurity | None = None, timeout_s: float = 30.0):
        self.address = address
        self.channel = open_channel(address, security)
        self.stub = prompts_pb2_grpc.PromptServiceStub(self.channel)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

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
                return list(self.stub.Submit(prompts_pb2.SubmitRequest(prompts=specs), timeout=self.timeout_s,
                                             wait_for_ready=True).prompt_ids)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(retry_after_s(exc))

    def results(self, prompt_ids: list[str] | None = None, tag: str | None = None, follow: bool = True,
                timeout_s: float | None = None) -> Iterator[prompts_pb2.PromptResult]:
        """Each result of `prompt_ids` (ends when all are finished) or of `tag` (with follow: until timeout_s)."""
        request = prompts_pb2.ResultsRequest(prompt_ids=prompt_ids or [], tag=tag or "", follow=follow)
        yield from self.stub.StreamResults(request, timeout=timeout_s, wait_for_ready=True)

    def follow(self, prompt_ids: list[str], reconnect_s: float = 60.0,
               on_reconnect=None) -> Iterator[prompts_pb2.PromptResult]:
        """Each result of `prompt_ids` once, across server restarts: a stream that breaks (RECONNECT_CODES) is
        called again for the prompts not yet answered, as soon as the server is back, with backoff; the error is
        raised when none has come back `reconnect_s` seconds after the break. `on_reconnect(error)` is called
        before each new attempt (to say so)."""
        left, delay = list(dict.fromkeys(prompt_ids)), 0.5
        while left:
            try:
                for result in self.results(left):
                    if result.prompt_id in left:  # a result already yielded is never repeated
                        left.remove(result.prompt_id)
                        delay = 0.5
                        yield result
                return
            except grpc.RpcError as exc:
                if exc.code() not in RECONNECT_CODES:
                    raise
                self._reconnect(exc, reconnect_s, delay, on_reconnect)
                delay = min(2 * delay, 5.0)

    def _reconnect(self, error: grpc.RpcError, within_s: float, delay_s: float, on_reconnect) -> None:
        """Wait for the channel to be ready again (after `delay_s`, so a server failing at once is not hammered);
        `error` when it is not within `within_s`."""
        if on_reconnect is not None:
            on_reconnect(error)
        time.sleep(delay_s)
        try:  # a StreamResults call has no deadline: it would wait for a server that never returns forever
            grpc.channel_ready_future(self.channel).result(timeout=max(0.0, within_s - delay_s))
        except grpc.FutureTimeoutError:
            raise error from None

    def cancel(self, prompt_ids: list[str]) -> prompts_pb2.CancelReply:
        return self.stub.Cancel(prompts_pb2.CancelRequest(prompt_ids=prompt_ids), timeout=self.timeout_s,
                                wait_for_ready=True)

    def status(self) -> prompts_pb2.RunStatus:
        return self.stub.GetStatus(prompts_pb2.StatusRequest(), timeout=self.timeout_s, wait_for_ready=True)
