"""The config section of a sampler's OpenAI-compatible HTTP endpoint (sampler_service/openai_server.py;
docs/openai-endpoint.md): evaluation harnesses, agent frameworks and `verifiers` environments call the live policy
through it, on the sampler's engine and weights."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.base import Strict
from grpo_stream.common.registry.tasks import task_spec


class OpenAISection(Strict):
    port: int | None = Field(None, ge=0, le=65535, description="Port of sampler 0's endpoint (sampler i serves on "
                             "port + i); 0: a free port (written to RUN_DIR/openai-<sampler id>.json); null: no "
                             "endpoint.")
    host: str = Field("127.0.0.1", description="Address the endpoint binds. Beyond loopback serve it over TLS "
                      "(tls.*, the gRPC servers' certificate); tls.plaintext_bind applies as to them.")
    model_name: str | None = Field(None, max_length=256, description="The model id `/v1/models` lists and requests "
                                   "name; null: run.name.")
    max_concurrent: int = Field(64, ge=1, le=100_000, description="Requests decoding or waiting for the engine at "
                                "once; beyond it a request is answered 429 with Retry-After.")
    max_concurrent_per_token: int | None = Field(None, ge=1, le=100_000, description="Requests of one client token "
                                                 "open at once (of max_concurrent); beyond it that token is answered "
                                                 "429, so one client cannot take every place. Null: half of "
                                                 "max_concurrent (at least 1). With auth.mode=none every caller is "
                                                 "one anonymous client and only max_concurrent applies.")
    max_queued: int = Field(256, ge=1, le=1_000_000, description="Sequences (a request's n choices each count) "
                            "waiting for the engine; beyond it 429.")
    max_engine_share: float = Field(0.5, gt=0, le=1, description="Most of the engine's decode slots (generation."
                                    "decode_slots, or sampler.vllm.max_num_seqs) the endpoint's sequences take at "
                                    "once (at least one); the others are the sampler's own rows, however many "
                                    "sequences clients queue. 1: the endpoint may fill the engine (a sampler that "
                                    "serves only the endpoint).")
    max_n: int = Field(64, ge=1, le=4096, description="Largest `n` (choices per request); at most max_queued, since "
                       "a request's sequences are queued all at once.")
    request_timeout_s: float = Field(600.0, gt=0, le=86_400, description="A request not answered in this time is "
                                     "answered 504 and its sequences are withdrawn (on the JAX engine those decoding "
                                     "stop too).")
    max_body_bytes: int = Field(4 << 20, ge=1024, le=1 << 30, description="Largest request body; beyond it 413.")
    max_context_tokens: int | None = Field(None, ge=8, le=1 << 20, description="The endpoint's context: most "
                                           "prompt + completion tokens of one request (a chat's later turns are "
                                           "longer prompts); a completion still takes at most generation."
                                           "max_new_tokens. Null: the training rollouts' generation.max_prompt_tokens "
                                           "+ max_new_tokens. Above that, the sampler's JAX engine holds this many KV "
                                           "positions per sequence (memory of decode_slots x this once a long one is "
                                           "live) and vLLM's max_model_len is this; the model's own limits (Gemma's "
                                           "sliding window) are checked at start-up, naming this field.")
    max_prompt_chars: int | None = Field(None, ge=64, le=1 << 30, description="Most characters of a request's "
                                         "prompts or messages, refused (400) before anything is tokenized; null: 16 x "
                                         "max_context_tokens less generation.max_new_tokens (by default 16 x "
                                         "generation.max_prompt_tokens).")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, description="A connection whose request head (its first, "
                                    "or a later one on a kept-alive connection) is not complete this long after it "
                                    "began is closed.")
    keep_alive_s: float = Field(30.0, gt=0, le=3600, description="An idle keep-alive connection is closed after "
                                "this long. Keep it above your clients' own idle expiry (httpx, which the openai SDK "
                                "uses: 5 s): at equal times a client may send on a connection the server is closing, "
                                "and that request fails with 'Server disconnected'.")
    body_timeout_s: float = Field(30.0, gt=0, le=3600, description="A request whose body has not arrived in this "
                                  "time is answered 408 (it holds no place among max_concurrent meanwhile).")
    max_connections: int = Field(1024, ge=16, le=1_000_000, description="Open connections in all; beyond it a new "
                                 "one is closed as it is accepted. The sampler raises its open-file limit to fit them "
                                 "beside its own descriptors.")
    max_connections_per_address: int = Field(128, ge=1, le=1_000_000, description="Open connections from one client "
                                             "address; beyond it a new one is closed as it is accepted.")
    tool_format: Literal["qwen", "llama3", "gemma", "plain"] | None = Field(
        None, description="How the model writes tool calls, parsed into a chat completion's `tool_calls` when the "
        "request lists tools (and how tools and calls are written into the prompt for a chat template that does not "
        "write them itself); null: the run's, environment.tool_format or the one inferred from the chat template.")

    @model_validator(mode="after")
    def _limits_agree(self) -> "OpenAISection":
        if self.max_n > self.max_queued:
            raise ValueError(f"sampler.openai.max_n={self.max_n} exceeds sampler.openai.max_queued={self.max_queued}: "
                             "a request of n choices queues n sequences at once, so larger ones could never be "
                             "served; lower max_n or raise max_queued")
        if self.max_concurrent_per_token is not None and self.max_concurrent_per_token > self.max_concurrent:
            raise ValueError(f"sampler.openai.max_concurrent_per_token={self.max_concurrent_per_token} exceeds "
                             f"sampler.openai.max_concurrent={self.max_concurrent}; lower it (null: half of "
                             "max_concurrent)")
        return self

    def per_token_limit(self) -> int:
        """Requests one client token may have open at once: max_concurrent_per_token, or half of max_concurrent."""
        return self.max_concurrent_per_token or max(1, self.max_concurrent // 2)


def endpoint_engine_rows(cfg) -> int:
    """Most endpoint sequences inside the sampler's engine at once: sampler.openai.max_engine_share of its slots, at
    least one; the other slots are the sampler's own rows'."""
    return max(1, int(cfg.engine_slots()[1] * cfg.sampler.openai.max_engine_share))


def endpoint_context(cfg) -> int:
    """The endpoint's context in tokens: sampler.openai.max_context_tokens, or the rollouts' prompt + completion."""
    gen = cfg.generation
    return cfg.sampler.openai.max_context_tokens or gen.max_prompt_tokens + gen.max_new_tokens


def engine_context(cfg) -> tuple[int, str]:
    """(KV positions per sequence a sampler's engine must hold, the config field that asks for them): the rollouts'
    prompt + completion, or the endpoint's context when it serves one that is longer."""
    gen = cfg.generation
    rollouts = gen.max_prompt_tokens + gen.max_new_tokens
    if serves_endpoint(cfg) and endpoint_context(cfg) > rollouts:
        return endpoint_context(cfg), "sampler.openai.max_context_tokens"
    return rollouts, "generation.max_prompt_tokens + generation.max_new_tokens"


def serves_endpoint(cfg) -> bool:
    """Whether the samplers serve the endpoint: sampler.openai.port is set, or the run trains on a verifiers
    environment (its rollouts call its routes in memory; nothing listens when no port is set)."""
    return cfg.sampler.openai.port is not None or task_spec(cfg.task.name).own_rollouts
