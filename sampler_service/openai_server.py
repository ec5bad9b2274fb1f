"""A sampler's OpenAI-compatible HTTP endpoint (sampler.openai; docs/openai-endpoint.md): the routes of
common/endpoint/app.py served by uvicorn on a thread of the sampler, over the sampler's engine and its installed
weights. TLS is the gRPC servers' (tls.*); a plaintext bind beyond loopback is warned about or refused as theirs are
(tls.plaintext_bind). Who may call, and the limits: common/endpoint/app.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import secrets
import ssl
import threading
import time
import types
from typing import Any, Iterator

import uvicorn

from grpo_stream.common.config.serving import endpoint_engine_rows
from grpo_stream.common.endpoint.app import InProcessRoutes, build_app, endpoint_core
from grpo_stream.common.engine.side_requests import SideQueue, serve_idle
from grpo_stream.common.rpc.auth import load_table
from grpo_stream.common.rpc.grpc_util import check_plaintext_bind
from grpo_stream.sampler_service.endpoint_listener import ConnectionLimits, guarded_protocol, raise_open_files

log = logging.getLogger(__name__)


def _ssl_options(tls) -> dict[str, Any]:
    if not tls.enabled:
        return {}
    options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.require_client_cert:
        options.update(ssl_ca_certs=tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class Endpoint:
    """The running endpoint of one sampler: its HTTP server thread (when sampler.openai.port is set) and its
    idle-serving thread. The listener's app never accepts the internal token; the sampler's own rollouts call a
    second app over the same core in memory (`routes`)."""

    def __init__(self, cfg, index: int, sampler_id: str, engine, tokenizer, current, run_dir: pathlib.Path | None):
        settings = cfg.sampler.openai
        self.queue = SideQueue(settings.max_queued, endpoint_engine_rows(cfg))
        engine.side = self.queue
        self.engine, self.sampler_id, self.stop = engine, sampler_id, threading.Event()
        self.core = endpoint_core(cfg, engine, self.queue, tokenizer)
        self.internal_token = secrets.token_urlsafe(32)
        self.private_app = build_app(self.core, None, settings, self.internal_token)
        self._threads = [threading.Thread(target=serve_idle, args=(engine, self.queue, current, self.stop),
                                          name=f"{sampler_id}-openai-idle", daemon=True)]
        self.app, self.server, self.url, self.limits = self.private_app, None, None, None
        try:
            if settings.port is not None:  # else a verifiers run's own routes only: nothing listens
                self._listen(cfg, index)
            for thread in self._threads:
                thread.start()
            if self.server is not None:
                self.url = self._await_started(settings.host, cfg.tls.enabled)
        except BaseException:
            # what started stops (the idle thread polled the queue for ever, holding the engine and the weights)
            self.close()
            raise
        if self.server is not None:
            log.info("%s serves the OpenAI API at %s (model %r)", sampler_id, self.url, self.core.model_name)
            if run_dir is not None:
                (run_dir / f"openai-{sampler_id}.json").write_text(json.dumps(
                    {"url": self.url, "model": self.core.model_name}) + "\n")

    def _listen(self, cfg, index: int) -> None:
        """The public app (client tokens; never the internal one) behind the guarded listener."""
        settings = cfg.sampler.openai
        self.app = build_app(self.core, load_table(cfg.auth) if cfg.auth.mode != "none" else None, settings, None,
                             open_access=cfg.auth.mode == "none")
        if not cfg.tls.enabled:
            check_plaintext_bind(settings.host, types.SimpleNamespace(tls=None, ssl_context=None,
                                                                      plaintext_bind=cfg.tls.plaintext_bind),
                                 "sampler.openai.host")
        connections = raise_open_files(settings.max_connections)
        # an answer not taken is held to the body's deadline: one for what moves in either direction
        self.limits = ConnectionLimits(settings.header_timeout_s, connections,
                                       min(connections, settings.max_connections_per_address), settings.body_timeout_s)
        config = uvicorn.Config(self.app, host=settings.host, port=settings.port + index if settings.port else 0,
                                log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2,
                                timeout_keep_alive=settings.keep_alive_s,
                                http=guarded_protocol(self.limits), backlog=min(2048, connections),
                                **_ssl_options(cfg.tls))
        self.server = uvicorn.Server(config)
        self._threads.append(threading.Thread(target=self.server.run, name=f"{self.sampler_id}-openai", daemon=True))

    def _await_started(self, host: str, tls: bool) -> str:
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._threads[-1].is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"sampler.openai: the endpoint did not start on {host} (port in use?)")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if tls else 'http'}://{shown}:{port}/v1"

    @property
    def routes(self) -> InProcessRoutes:
        """The routes as the sampler's own rollouts call them (in memory, the internal token)."""
        return InProcessRoutes(self.private_app, self.internal_token, self.core.model_name,
                               self.core.rollout_versions)

    def figures(self) -> dict:
        gate = self.app.state.gate
        listener = {} if self.limits is None else {"connections_refused": self.limits.refused,
                                                   "connections_timed_out": self.limits.timed_out,
                                                   "answers_not_taken": self.limits.send_timed_out}
        return {"url": self.url, "requests": gate.served, "refused_busy": gate.refused, **listener,
                "sequences": self.queue.served, "sequences_in_sampler_batches": self.queue.served_in_sampler_batches,
                "chat_turns_continued": self.core.chat_prompts.continued,
                "chat_prompts_rendered_whole": self.core.chat_prompts.rendered_whole}

    def close(self) -> None:
        self.stop.set()
        self.core.stop("the sampler is stopping")  # what waits, and what comes before the server stops: 503
        if self.server is not None:
            self.server.should_exit = True
        for thread in self._threads:
            if thread.is_alive():  # (one never started when the start failed part-way)
                thread.join(timeout=5)
        if self.server is not None:  # nothing reaches its app now (the private app's parser goes with the app)
            self.app.state.parser.shutdown(wait=False)
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
