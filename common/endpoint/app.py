"""The OpenAI-compatible routes over an engine (`build_app`): what a sampler's endpoint serves over HTTP
(sampler_service/openai_server.py) and what a `verifiers` environment's rollouts call in the same process (httpx's ASGI
transport), on a sampler or in the trainer's evaluation.

Who may call: the bearer tokens of the gRPC servers (auth.*), roles client or admin (ROLES_BY_METHOD lists the
routes); no token or an unknown one is answered 401, a sampler token 403; the process's own rollouts call with an
internal token held only in memory. At most sampler.openai.max_concurrent requests are open at once, at most
max_concurrent_per_token of one token, and max_queued sequences wait for the engine; beyond any of these a request is
answered 429 with Retry-After, at once. A client that closes its connection before its answer frees its place and its
sequences at once. Bodies over max_body_bytes are answered 413 without being read further; a body is parsed off the
event loop, PARSERS at a time. A stopping sampler answers 503 with Retry-After (EndpointCore.stop). Errors use OpenAI's
shape, {"error": {"message", "type", "param", "code"}}, and name the field; a fault of the endpoint's own is a 500 in
that shape and one log line.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import secrets
import threading
import time
from typing import Any, Iterator

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from grpo_stream.common.config.serving import endpoint_context, endpoint_engine_rows
from grpo_stream.common.endpoint.body import parse as _parse  # (as `_parse`: tests hold it to watch where it runs)
from grpo_stream.common.endpoint.generation import INTERNAL, EndpointCore, RolloutVersions, Unavailable
from grpo_stream.common.endpoint.protocol import (ChatRequest, CompletionRequest, RequestError, StreamOptions,
                                                  UnknownModel)
from grpo_stream.common.endpoint.streaming import sse_events
from grpo_stream.common.engine.side_requests import QueueFull, SideQueue
from grpo_stream.common.environments.tool_episode import run_tool_format
from grpo_stream.common.rpc.auth import Caller, TokenTable, bearer_value, caller_refusal_http


log = logging.getLogger(__name__)
# bodies parsed at once: parsing holds the GIL, so more at once is no faster, only more memory at its peak
PARSERS = 2


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool"}
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null or nothing"}


def _union_tag(part) -> bool:
    """Whether a part of an error's location is pydantic's name for one branch of a union field (`list[int]`),
    not a field of the request."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def _validation_message(exc: pydantic.ValidationError) -> tuple[str, str | None]:
    """(the message, the field) of a body's first invalid field; a union field (stop, prompt, tool_choice) is named
    with the forms it takes, never with pydantic's branch names as if they were fields."""
    errors = exc.errors()
    loc = list(errors[0].get("loc", ()))
    if not loc and errors[0].get("type") == "model_type":  # pydantic names the class, which no client knows
        sent = _JSON_KINDS.get(type(errors[0].get("input")), "something else")
        return f"the body: should be a JSON object of the request's fields (model, prompt/messages), not {sent}", None
    tag = next((i for i, part in enumerate(loc) if _union_tag(part)), None)
    sent = errors[0].get("input")
    if tag is None and isinstance(sent, bool) and errors[0].get("type") in ("int_type", "float_type"):
        field = ".".join(str(p) for p in loc)  # pydantic's "a valid integer" of JSON's true, which it reads as 1
        return f"{field}: should be a number, not {str(sent).lower()}", field
    if tag is None:
        field = ".".join(str(p) for p in loc) or None
        # a validator's own message already names its field (pydantic prefixes "Value error, ")
        msg = str(errors[0].get("msg")).removeprefix("Value error, ")
        return (f"{field}: {msg}" if field and not msg.startswith(f"{field}:") else msg), field
    field, prefix = ".".join(str(p) for p in loc[:tag]), loc[:tag]
    forms = list(dict.fromkeys(str(e["loc"][tag]) for e in errors
                               if list(e.get("loc", ()))[:tag] == prefix and len(e["loc"]) > tag))
    return f"{field}: should be one of {', '.join(forms)}", field


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes (not read further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


class Gate:
    """Requests open at once, bounded in all (sampler.openai.max_concurrent) and per caller (max_concurrent_per_token;
    None: no per-caller bound); counted for /metrics and the summary."""

    def __init__(self, limit: int, per_caller: int | None = None):
        self.limit, self.per_caller, self.open, self.served, self.refused = limit, per_caller, 0, 0, 0
        self._by_caller: collections.Counter[str] = collections.Counter()  # only callers with requests open
        self._lock = threading.Lock()

    def _refusal(self, caller: str) -> str | None:
        if self.open >= self.limit:
            return f"{self.limit} requests are open (sampler.openai.max_concurrent)"
        if self.per_caller is not None and self._by_caller[caller] >= self.per_caller:
            return (f"this token has {self.per_caller} requests open (sampler.openai.max_concurrent_per_token="
                    f"{self.per_caller})")
        return None

    @contextlib.contextmanager
    def enter(self, caller: str, bypass: bool = False) -> Iterator[str | None]:
        """None when `caller`'s request may proceed now, else why not; `bypass`: the sampler's own (its batches are
        sized by its config)."""
        with self._lock:
            refused = None if bypass else self._refusal(caller)
            if refused is None:
                self.open += 1
                self._by_caller[caller] += 1
            else:
                self.refused += 1
        try:
            yield refused
        finally:
            if refused is None:
                with self._lock:
                    self.open -= 1
                    self.served += 1
                    self._by_caller[caller] -= 1
                    if self._by_caller[caller] <= 0:
                        del self._by_caller[caller]


class ClientLeft(Exception):
    """The client closed its connection before its answer."""


async def _client_left(request: Request) -> None:
    """Returns once the client has gone: with its whole body read, the server's receive() has nothing more to give
    until it says http.disconnect (uvicorn: the connection was lost; in memory: never before the answer is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(request: Request, work) -> Any:
    """`work`'s result, or ClientLeft when the client goes first: `work` is then cancelled, which withdraws its
    sequences (generation.py; the engine stops those already decoding) and so frees its place at the gate."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task  # its cancellation runs to the end: the sequences are withdrawn before the place is freed
    raise ClientLeft


async def _answer(request: Request, route: str, work, timeout_s: float, stream=None) -> Response:
    """The handler's answer, or its error in OpenAI's shape; nothing when the client leaves first (its work is
    cancelled, its sequences withdrawn). `stream`: the request's StreamOptions when it asked for `stream: true`
    (an error is still a JSON answer: nothing was streamed yet)."""
    try:
        answer = await _unless_client_leaves(request, work)
        if stream is not None:  # written whole off the loop first: a fault is a 500 below, never a cut stream
            events = await asyncio.to_thread(lambda: list(sse_events(answer, stream.include_usage)))
            return StreamingResponse(iter(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        # written off the event loop, as the answer was built: n long choices with logprobs are megabytes of JSON
        # and a second of the loop, every other client unread meanwhile
        return Response(await asyncio.to_thread(_json_bytes, answer), media_type="application/json")
    except ClientLeft:
        log.info("endpoint: %s left before its answer to %s; its sequences were withdrawn", _peer(request), route)
        return _error(400, "the client left before its answer")
    except RequestError as exc:
        return _error(404 if isinstance(exc, UnknownModel) else 400, str(exc),
                      param=str(exc).split(":", 1)[0].split("=", 1)[0])
    except QueueFull as exc:
        return _error(429, f"{exc}; retry later", "rate_limit_error", headers={"Retry-After": "1"})
    except asyncio.TimeoutError:
        return _error(504, f"not answered within sampler.openai.request_timeout_s={timeout_s}",
                      "timeout_error")
    except Unavailable as exc:
        return _error(503, str(exc), "server_error", headers={"Retry-After": "1"})
    except RecursionError:  # a part of the body nested deeper than a step of handling it goes
        return _error(400, "the body's JSON nests too deep")
    except Exception as exc:  # noqa: BLE001 - our fault, not the client's: an answer in OpenAI's shape, one line
        log.error("endpoint: %s from %s failed: %s: %s", route, _peer(request), type(exc).__name__,
                  str(exc)[:300])
        return _error(500, "the endpoint failed on this request (the sampler's log says why)", "server_error")


def _json_bytes(answer: dict[str, Any]) -> bytes:
    """`answer` as JSONResponse writes it (UTF-8, compact; NaN refused)."""
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def _validated(model: type[pydantic.BaseModel], body: bytes) -> Any:
    """The body as a `model` request, or the 400 that names what is wrong with it."""
    try:
        return model.model_validate(_parse(body))
    except pydantic.ValidationError as exc:
        message, field = _validation_message(exc)
        return _error(400, message, param=field)
    except RecursionError:  # nested deeper than the parser, or pydantic, goes
        return _error(400, "the body's JSON nests too deep")
    except ValueError as exc:  # not JSON, or not text
        return _error(400, str(exc), param=getattr(exc, "field", None))


def build_app(core: EndpointCore, table: TokenTable | None, settings, internal_token: str | None,
              open_access: bool = False) -> FastAPI:
    """The routes. `table`: the tokens callers present (None: no caller but the process itself); `internal_token`:
    the process's own (its `verifiers` rollouts call these routes in memory with it), held in memory only; None for
    the app a listener serves, which never accepts it; `open_access`: auth.mode=none, anyone who reaches the port."""
    app = FastAPI(title="grpo-stream sampler", docs_url=None, redoc_url=None, openapi_url=None)
    # auth.mode=none: every caller is the one anonymous client, bounded by max_concurrent alone
    gate = Gate(settings.max_concurrent, None if open_access else settings.per_token_limit())
    parser = concurrent.futures.ThreadPoolExecutor(PARSERS, thread_name_prefix="endpoint-parse")
    app.state.gate, app.state.parser = gate, parser

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException):
        """An unknown route (404) or verb (405) in OpenAI's error shape, as every other answer (the SDK reads
        error.message)."""
        return _error(exc.status_code, f"{request.method} {request.url.path[:200]}: {exc.detail} (this endpoint "
                      "serves GET /v1/models, POST /v1/completions and POST /v1/chat/completions)",
                      headers=getattr(exc, "headers", None))

    def authorized(request: Request, route: str) -> tuple[Caller | None, JSONResponse | None]:
        """(the caller, None) or (None, the refusal)."""
        token = bearer_value(request.headers.get("authorization"))
        if token and internal_token and hmac.compare_digest(token.encode(), internal_token.encode()):
            caller = Caller(INTERNAL, "client")
        elif open_access:
            caller = Caller("anonymous", "admin")
        else:
            caller = table.lookup(token) if token and table is not None else None
        why = caller_refusal_http(caller, route)
        if why is None:
            return caller, None
        return None, _error(why[0], why[1], "authentication_error" if why[0] == 401 else "permission_error")

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := authorized(request, "GET /v1/models")[1]) is not None:
            return denied
        return {"object": "list", "data": [{"id": core.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "grpo-stream", "max_model_len":
                                            core.context_tokens}]}

    async def serve(request: Request, route: str, model: type[pydantic.BaseModel], handler) -> Response:
        caller, denied = authorized(request, route)
        if denied is not None:
            return denied
        try:  # read before the gate: a stalled body holds no place among max_concurrent
            body = await asyncio.wait_for(_read_body(request, settings.max_body_bytes), settings.body_timeout_s)
        except asyncio.TimeoutError:
            return _error(408, "the body did not arrive within sampler.openai.body_timeout_s="
                          f"{settings.body_timeout_s}")
        except ClientDisconnect:
            log.info("endpoint: %s left before sending its whole body", _peer(request))
            return _error(400, "the client left before sending its whole body")
        if body is None:
            return _error(413, f"request body over sampler.openai.max_body_bytes={settings.max_body_bytes}")
        with gate.enter(caller.name, bypass=caller.name == INTERNAL) as refused:
            if refused is not None:
                return _error(429, f"{refused}; retry later", "rate_limit_error", headers={"Retry-After": "1"})
            # off the event loop (seconds for a body of a million small objects, every other client waiting) and a
            # few at a time (one such body is ~30 times its size in Python objects while it is parsed)
            parsed = await asyncio.get_running_loop().run_in_executor(parser, _validated, model, body)
            del body  # not held while the request waits for the engine
            if isinstance(parsed, Response):
                return parsed
            stream = (parsed.stream_options or StreamOptions()) if parsed.stream else None
            return await _answer(request, route, handler(parsed, caller.name), core.timeout_s, stream)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, "POST /v1/chat/completions", ChatRequest, core.chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "POST /v1/completions", CompletionRequest, core.completion)

    return app


@dataclasses.dataclass(frozen=True)
class InProcessRoutes:
    """The routes as this process's own rollouts call them (common/episodes/verifiers.py): in memory, with a token
    held only here."""
    app: Any
    token: str
    model_name: str
    versions: RolloutVersions


def endpoint_core(cfg, engine, queue: SideQueue, tokenizer) -> EndpointCore:
    """The routes' core over `engine` with the run's generation settings and sampler.openai's limits."""
    settings, gen = cfg.sampler.openai, cfg.generation
    support = getattr(tokenizer, "tool_support", None)
    if settings.tool_format and support is not None and not support.complete \
            and settings.tool_format != tokenizer.tool_format:
        log.warning("sampler.openai.tool_format=%s: the endpoint writes the %s its chat template leaves out in this "
                    "format (the run's episodes: %r)", settings.tool_format, support.missing(), tokenizer.tool_format)
    return EndpointCore(engine, queue, tokenizer, settings.model_name or cfg.run.name, endpoint_context(cfg),
                        gen.max_new_tokens, gen.temperature, settings.tool_format or run_tool_format(cfg, tokenizer),
                        settings.max_n, settings.request_timeout_s, settings.max_prompt_chars)


@contextlib.contextmanager
def in_process_routes(cfg, engine, tokenizer) -> Iterator[InProcessRoutes]:
    """Routes over `engine` for this process's own rollouts only (no listener, no outside caller), while the block
    runs: the trainer's evaluation of a verifiers environment. Their requests join whatever serve the engine runs."""
    queue = SideQueue(cfg.sampler.openai.max_queued, endpoint_engine_rows(cfg))
    engine.side = queue
    core = endpoint_core(cfg, engine, queue, tokenizer)
    token = secrets.token_urlsafe(32)
    app = build_app(core, None, cfg.sampler.openai, token)
    try:
        yield InProcessRoutes(app, token, core.model_name, core.rollout_versions)
    finally:
        core.stop("the evaluation ended")  # a call that comes later is answered 503, never left waiting
        engine.side = None
