"""The OpenAI-compatible routes over an engine (`build_app`): what a sampler's endpoint serves over HTTP
(sampler_service/openai_server.py) and what a `verifiers` environment's rollouts call in the same process (httpx's ASGI
transport), on a sampler or in the trainer's evaluation.

Who may call: the bearer tokens of the gRPC servers (auth.*), roles client or admin (ROLES_BY_METHOD lists the
routes); no token or an unknown one is answered 401, a sampler token 403; the process's own rollouts call with an
internal token held only in memory. At most sampler.openai.max_concurrent requests are open at once and max_queued
sequences wait for the engine; beyond either a request is answered 429 with Retry-After, at once. Bodies over
max_body_bytes are answered 413 without being read further. Errors use OpenAI's shape, {"error": {"message", "type",
"param", "code"}}, and name the field.
"""

from __future__ import annotations

import asyncio
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
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from grpo_stream.common.config.serving import endpoint_context
from grpo_stream.common.endpoint.generation import INTERNAL, EndpointCore, RolloutVersions, Unavailable
from grpo_stream.common.endpoint.protocol import ChatRequest, CompletionRequest, RequestError
from grpo_stream.common.engine.side_requests import QueueFull, SideQueue
from grpo_stream.common.environments.tool_episode import run_tool_format
from grpo_stream.common.rpc.auth import Caller, TokenTable, bearer_value, caller_refusal_http


log = logging.getLogger(__name__)


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _validation_message(exc: pydantic.ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ())) or None
    return f"{field}: {first.get('msg')}" if field else str(first.get("msg")), field


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


def _parse(body: bytes):
    """The body's JSON; ValueError naming the position for one that is not JSON (RecursionError for one nested
    deeper than Python's parser goes)."""
    try:
        return json.loads(body or b"null")
    except json.JSONDecodeError as exc:
        raise ValueError(f"the body is not JSON ({exc.msg} at position {exc.pos})") from None


class Gate:
    """Requests open at once, bounded (sampler.openai.max_concurrent); counted for /metrics and the summary."""

    def __init__(self, limit: int):
        self.limit, self.open, self.served, self.refused = limit, 0, 0, 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def enter(self, bypass: bool = False) -> Iterator[bool]:
        """Whether a request may proceed now; `bypass`: the sampler's own (its batches are sized by its config)."""
        with self._lock:
            admitted = bypass or self.open < self.limit
            self.open += admitted
            self.refused += not admitted
        try:
            yield admitted
        finally:
            if admitted:
                with self._lock:
                    self.open -= 1
                    self.served += 1


def build_app(core: EndpointCore, table: TokenTable | None, settings, internal_token: str | None,
              open_access: bool = False) -> FastAPI:
    """The routes. `table`: the tokens callers present (None: no caller but the process itself); `internal_token`:
    the process's own (its `verifiers` rollouts call these routes in memory with it), held in memory only; None for
    the app a listener serves, which never accepts it; `open_access`: auth.mode=none, anyone who reaches the port."""
    app = FastAPI(title="grpo-stream sampler", docs_url=None, redoc_url=None, openapi_url=None)
    gate = Gate(settings.max_concurrent)
    app.state.gate = gate

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

    async def serve(request: Request, route: str, model: type[pydantic.BaseModel], handler) -> JSONResponse:
        caller, denied = authorized(request, route)
        if denied is not None:
            return denied
        try:  # read before the gate: a stalled body holds no place among max_concurrent
            body = await asyncio.wait_for(_read_body(request, settings.max_body_bytes), settings.body_timeout_s)
        except asyncio.TimeoutError:
            return _error(408, f"the body did not arrive within sampler.openai.body_timeout_s={settings.body_timeout_s}")
        except ClientDisconnect:
            log.info("endpoint: %s left before sending its whole body", _peer(request))
            return _error(400, "the client left before sending its whole body")
        if body is None:
            return _error(413, f"request body over sampler.openai.max_body_bytes={settings.max_body_bytes}")
        with gate.enter(bypass=caller.name == INTERNAL) as admitted:
            if not admitted:
                return _error(429, f"{gate.limit} requests are open (sampler.openai.max_concurrent); retry later",
                              "rate_limit_error", headers={"Retry-After": "1"})
            try:
                parsed = model.model_validate(_parse(body))
            except pydantic.ValidationError as exc:
                return _error(400, *_validation_message(exc))
            except RecursionError:  # nested deeper than the parser, or pydantic, goes
                return _error(400, "the body's JSON nests too deep")
            except ValueError as exc:  # not JSON
                return _error(400, str(exc))
            try:
                return JSONResponse(await handler(parsed, caller.name))
            except RequestError as exc:
                return _error(400, str(exc), param=str(exc).split(":", 1)[0].split("=", 1)[0])
            except QueueFull as exc:
                return _error(429, f"{exc}; retry later", "rate_limit_error", headers={"Retry-After": "1"})
            except asyncio.TimeoutError:
                return _error(504, f"not answered within sampler.openai.request_timeout_s={core.timeout_s}",
                              "timeout_error")
            except Unavailable as exc:
                return _error(503, str(exc), "server_error")

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
    queue = SideQueue(cfg.sampler.openai.max_queued)
    engine.side = queue
    core = endpoint_core(cfg, engine, queue, tokenizer)
    token = secrets.token_urlsafe(32)
    try:
        yield InProcessRoutes(build_app(core, None, cfg.sampler.openai, token), token, core.model_name,
                              core.rollout_versions)
    finally:
        queue.fail_waiting("the evaluation ended")
        engine.side = None
