"""A sampler's OpenAI-compatible HTTP endpoint (sampler.openai; docs/openai-endpoint.md): FastAPI routes served by
uvicorn on a thread of the sampler, over the sampler's engine and its installed weights.

Who may call: the bearer tokens of the gRPC servers (auth.*), roles client or admin (ROLES_BY_METHOD lists the
routes); no token or an unknown one is answered 401, a sampler token 403. TLS is the gRPC servers' (tls.*); a
plaintext bind beyond loopback is warned about or refused as theirs are (tls.plaintext_bind). At most
sampler.openai.max_concurrent requests are open at once and max_queued sequences wait for the engine; beyond
either a request is answered 429 with Retry-After, at once. Bodies over max_body_bytes are answered 413 without
being read further. Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}, and name the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import pathlib
import secrets
import ssl
import threading
import time
import types
from typing import Any, Iterator

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grpo_stream.common.engine.side_requests import QueueFull, SideQueue, serve_idle
from grpo_stream.common.rpc.auth import Caller, TokenTable, bearer_value, caller_refusal_http, load_table
from grpo_stream.common.rpc.grpc_util import check_plaintext_bind
from grpo_stream.sampler_service.openai_generation import INTERNAL, EndpointCore, Unavailable
from grpo_stream.sampler_service.openai_protocol import ChatRequest, CompletionRequest, RequestError

log = logging.getLogger(__name__)


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


def build_app(core: EndpointCore, table: TokenTable | None, settings, internal_token: str,
              open_access: bool = False) -> FastAPI:
    """The routes. `table`: the tokens callers present (None: no caller but the sampler itself); `internal_token`:
    the sampler's own (its `verifiers` rollouts call the endpoint with it), held in memory only and accepted as a
    client's; `open_access`: auth.mode=none, anyone who reaches the port."""
    app = FastAPI(title="grpo-stream sampler", docs_url=None, redoc_url=None, openapi_url=None)
    gate = Gate(settings.max_concurrent)
    app.state.gate = gate

    def authorized(request: Request, route: str) -> tuple[Caller | None, JSONResponse | None]:
        """(the caller, None) or (None, the refusal)."""
        token = bearer_value(request.headers.get("authorization"))
        if token and hmac.compare_digest(token.encode(), internal_token.encode()):
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
                                            core.max_prompt_tokens + core.max_new_tokens}]}

    async def serve(request: Request, route: str, model: type[pydantic.BaseModel], handler) -> JSONResponse:
        caller, denied = authorized(request, route)
        if denied is not None:
            return denied
        with gate.enter(bypass=caller.name == INTERNAL) as admitted:
            if not admitted:
                return _error(429, f"{gate.limit} requests are open (sampler.openai.max_concurrent); retry later",
                              "rate_limit_error", headers={"Retry-After": "1"})
            body = await _read_body(request, settings.max_body_bytes)
            if body is None:
                return _error(413, f"request body over sampler.openai.max_body_bytes={settings.max_body_bytes}")
            try:
                parsed = model.model_validate(json.loads(body or b"null"))
                return JSONResponse(await handler(parsed, caller.name))
            except json.JSONDecodeError as exc:
                return _error(400, f"the body is not JSON ({exc.msg} at position {exc.pos})")
            except pydantic.ValidationError as exc:
                return _error(400, *_validation_message(exc))
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


def _ssl_options(tls) -> dict[str, Any]:
    if not tls.enabled:
        return {}
    options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.require_client_cert:
        options.update(ssl_ca_certs=tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class Endpoint:
    """The running endpoint of one sampler: its HTTP server thread and its idle-serving thread."""

    def __init__(self, cfg, index: int, sampler_id: str, engine, tokenizer, current, run_dir: pathlib.Path | None):
        settings, gen = cfg.sampler.openai, cfg.generation
        self.queue = SideQueue(settings.max_queued)
        engine.side = self.queue
        self.engine, self.sampler_id, self.stop = engine, sampler_id, threading.Event()
        self.core = EndpointCore(engine, self.queue, tokenizer, settings.model_name or cfg.run.name, gen.max_prompt_tokens,
                                 gen.max_new_tokens, gen.temperature,
                                 settings.tool_format or cfg.environment.tool_format, settings.max_n,
                                 settings.request_timeout_s)
        self.internal_token = secrets.token_urlsafe(32)
        # sampler.openai.port unset (a verifiers run's own endpoint): on a free port, for this sampler's token only
        public = settings.port is not None
        self.app = build_app(self.core, load_table(cfg.auth) if public and cfg.auth.mode != "none" else None,
                             settings, self.internal_token, open_access=public and cfg.auth.mode == "none")
        if not cfg.tls.enabled:
            check_plaintext_bind(settings.host, types.SimpleNamespace(tls=None, ssl_context=None,
                                                                      plaintext_bind=cfg.tls.plaintext_bind),
                                 "sampler.openai.host")
        port = settings.port + index if settings.port else 0
        config = uvicorn.Config(self.app, host=settings.host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=2, **_ssl_options(cfg.tls))
        self.server = uvicorn.Server(config)
        self._threads = [threading.Thread(target=self.server.run, name=f"{sampler_id}-openai", daemon=True),
                         threading.Thread(target=serve_idle, args=(engine, self.queue, current, self.stop),
                                          name=f"{sampler_id}-openai-idle", daemon=True)]
        for thread in self._threads:
            thread.start()
        self.url = self._await_started(settings.host, cfg.tls.enabled)
        log.info("%s serves the OpenAI API at %s (model %r)", sampler_id, self.url, self.core.model_name)
        if run_dir is not None:
            (run_dir / f"openai-{sampler_id}.json").write_text(json.dumps(
                {"url": self.url, "model": self.core.model_name}) + "\n")

    def _await_started(self, host: str, tls: bool) -> str:
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._threads[0].is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"sampler.openai: the endpoint did not start on {host} (port in use?)")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if tls else 'http'}://{shown}:{port}/v1"

    def figures(self) -> dict:
        gate = self.app.state.gate
        return {"url": self.url, "requests": gate.served, "refused_busy": gate.refused,
                "sequences": self.queue.served, "sequences_in_sampler_batches": self.queue.served_in_sampler_batches,
                "chat_turns_continued": self.core.chat_prompts.continued,
                "chat_prompts_rendered_whole": self.core.chat_prompts.rendered_whole}

    def close(self) -> None:
        self.stop.set()
        self.queue.fail_waiting("the sampler is stopping")
        self.server.should_exit = True
        for thread in self._threads:
            thread.join(timeout=5)
        self.engine.side = None


@contextlib.contextmanager
def openai_endpoint(cfg, index: int, sampler_id: str, engine, tokenizer, current,
                    run_dir: pathlib.Path | None) -> Iterator[Endpoint]:
    """Sampler `index`'s endpoint while the block runs."""
    endpoint = Endpoint(cfg, index, sampler_id, engine, tokenizer, current, run_dir)
    try:
        yield endpoint
    finally:
        endpoint.close()
