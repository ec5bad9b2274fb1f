"""Config sections for who may talk to the services and how: auth tokens, TLS, Redis credentials, the calls a server
serves at once, and the limits of prompt injection. Secrets never live in a config file: sections name files or
environment variables that hold them (a config is committed and printed; a token file is mounted from a secret
store)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.base import FilePath, Strict

TOKENS_ENV = "GRPO_STREAM_TOKENS_FILE"  # the servers' token table (a file path)
TOKEN_ENV = "GRPO_STREAM_TOKEN"  # this process's own token as a client (the token itself)
TOKEN_FILE_ENV = "GRPO_STREAM_TOKEN_FILE"  # ... or a file holding it
REDIS_PASSWORD_ENV = "GRPO_STREAM_REDIS_PASSWORD"
MAX_MESSAGE_BYTES = 64 << 20  # the largest gRPC message every channel and server of a run sends and takes
BATCH_BYTES = MAX_MESSAGE_BYTES - (64 << 10)  # the most bytes of groups one rollout message carries (its framing)


class AuthSection(Strict):
    mode: Literal["tokens", "none"] = Field("tokens", description="'tokens': every RPC of every service needs a "
                                            "bearer token whose role the RPC accepts (sampler, client, admin). "
                                            "'none': no authentication, for a trusted network only (logged as a "
                                            "warning).")
    tokens_file: FilePath = Field(None, description=f"Servers: YAML list of {{name, role, token | sha256}} "
                                    f"(`grpo-stream tokens` writes one). ${TOKENS_ENV} overrides it. `up` makes one "
                                    "in RUN_DIR/auth when neither is set.")
    token_file: FilePath = Field(None, description=f"Clients (samplers, `submit`): file holding this process's "
                                   f"token. ${TOKEN_ENV} (the token) or ${TOKEN_FILE_ENV} (a file) override it.")
    open_health: bool = Field(False, description="Answer grpc.health.v1 Check and List without a token (for "
                              "platform probes that cannot send metadata). Everything else, Watch included, still "
                              "needs one. Anyone who reaches the port may then hold the probes' rpc.ops_calls "
                              "slots: keep the port on the cluster network.")


class TlsSection(Strict):
    enabled: bool = Field(False, description="Serve every gRPC server (and the weights TCP data plane) over TLS, "
                          "and connect to them over TLS.")
    cert_file: FilePath = Field(None, description="Servers: PEM certificate chain.")
    key_file: FilePath = Field(None, description="Servers: PEM private key of cert_file.")
    ca_file: FilePath = Field(None, description="PEM CA bundle: clients verify servers with it (null: the system "
                                "roots); with require_client_cert, servers verify clients with it.")
    require_client_cert: bool = Field(False, description="Mutual TLS: servers refuse clients without a certificate "
                                      "signed by ca_file.")
    client_cert_file: FilePath = Field(None, description="Clients, mutual TLS: PEM certificate presented to servers.")
    client_key_file: FilePath = Field(None, description="Clients, mutual TLS: PEM private key of client_cert_file.")
    server_name: str | None = Field(None, description="Clients: host name expected in the server certificate when it "
                                    "differs from the address dialled (e.g. an IP address).")
    plaintext_bind: Literal["warn", "refuse"] = Field(
        "warn", description="Servers without TLS asked to listen beyond loopback (e.g. 0.0.0.0) send bearer tokens "
        "and rollouts in the clear: 'warn' logs a warning at every such bind, 'refuse' stops the server naming this "
        "field. Loopback binds (127.0.0.1, ::1, localhost) are never warned about.")

    @model_validator(mode="after")
    def _pairs(self) -> "TlsSection":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls.cert_file and tls.key_file go together: give both or neither")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("tls.client_cert_file and tls.client_key_file go together: give both or neither")
        if self.require_client_cert and not self.ca_file:
            raise ValueError("tls.require_client_cert needs tls.ca_file (the CA that signs client certificates)")
        return self


class RedisAuthSection(Strict):
    username: str | None = Field(None, max_length=256, description="ACL user (Redis 6+); null: the default user.")
    password_file: FilePath = Field(None, description=f"File holding the Redis password; ${REDIS_PASSWORD_ENV} "
                                      "overrides it. Never put the password in redis.url.")
    tls_ca_file: FilePath = Field(None, description="rediss://: PEM CA that signs the Redis server certificate.")
    tls_cert_file: FilePath = Field(None, description="rediss:// with client certificates: PEM certificate.")
    tls_key_file: FilePath = Field(None, description="rediss:// with client certificates: PEM private key.")


class RedisSection(Strict):
    url: str | None = Field(None, description="redis://host:port/db (rediss:// for TLS, unix:///path); no password "
                            "here: see redis.auth. "
                            "Null: `up` starts an embedded redis-server (AOF on, data in RUN_DIR/redis) and hands "
                            "the trainer and samplers its URL.")
    connect_timeout_s: float | None = Field(None, gt=0, le=86_400, description="How long a service waits (with "
                                            "back-off, logging each retry) for an unreachable Redis before it exits; "
                                            "null = wait as long as it takes. A malformed URL, a wrong password or "
                                            "a missing database fail at once.")
    auth: RedisAuthSection = Field(default_factory=RedisAuthSection, description="ACL user, password source and "
                                   "TLS files for Redis.")
    allow_unsafe_persistence: bool = Field(False, description="Run on a Redis whose settings can lose acknowledged "
                                           "groups (append-only file off, appendfsync no, or an eviction policy "
                                           "other than noeviction), with a warning. False: the trainer, the "
                                           "standalone ingest and `up` refuse such a server at start-up, naming "
                                           "the setting. Only for runs whose data may be lost.")

    @model_validator(mode="after")
    def _scheme(self) -> "RedisSection":
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis.url={self.url!r} must start with redis://, rediss:// or unix:// "
                             "(e.g. redis://127.0.0.1:6379/0), or be null for an embedded Redis")
        if self.url is not None and "@" in self.url.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(f"redis.url: carries credentials; configs are committed and printed, so put the password "
                             f"in ${REDIS_PASSWORD_ENV} or a file named by redis.auth.password_file, and the user in "
                             "redis.auth.username")
        return self


class PromptsSection(Strict):
    max_batch: int = Field(256, ge=1, le=100_000, description="Prompts in one Submit call, ids in one Cancel call.")
    max_generations: int = Field(64, ge=1, le=4096, description="Largest num_generations a train=false prompt may "
                                 "ask for (a train=true prompt uses generation.num_generations).")
    max_priority: int = Field(9, ge=0, le=1_000_000, description="Priorities run 0..max_priority. A client's own "
                              "prompts go highest first; across clients a prompt of priority p weighs 1 + p in the "
                              "fair turns (a client at 9 gets 10 prompts to one at 0, never all). A token table "
                              "entry's max_priority lowers the ceiling for that token.")
    max_injected_fraction: float = Field(0.5, gt=0, le=1, description="The most of the rows of a sampler's groups "
                                         "injected prompts may take (counted over the groups admission grants it; the "
                                         "rest are dataset prompts), so no client can fill training with its own "
                                         "prompts. 1: no limit.")
    max_tags: int = Field(8, ge=0, le=256, description="Tags per prompt.")
    max_tag_chars: int = Field(64, ge=1, le=1024, description="Characters per tag.")
    max_text_chars: int = Field(32_768, ge=1, le=10_000_000, description="Characters of a prompt, question or "
                                "reference answer (the token limit is generation.max_prompt_tokens).")
    max_queued: int = Field(10_000, ge=1, le=10_000_000, description="Injected prompts waiting or claimed, across "
                            "clients; beyond it Submit answers RESOURCE_EXHAUSTED.")
    max_pending_per_client: int = Field(1_000, ge=1, le=10_000_000, description="Unfinished prompts one client "
                                        "(token name) may have; beyond it Submit answers RESOURCE_EXHAUSTED.")
    claim_lease_s: float = Field(300.0, gt=0, le=86_400, description="A claimed prompt not answered in this time "
                                 "goes back to the queue (its sampler died).")
    max_claims: int = Field(3, ge=1, le=1000, description="Leases a prompt may run out before it is given up: "
                            "finished as cancelled with an error its client reads, instead of being handed out "
                            "again for ever (samplers that drop it, e.g. wider than their groups, or whose "
                            "environment fails every episode of it). Raise it, or claim_lease_s, for prompts that "
                            "take longer than a lease to generate.")
    max_followers: int = Field(128, ge=1, le=10_000, description="StreamResults calls open at once; each holds a "
                               "server thread (beside the ingest's own), so followers never starve the samplers. "
                               "Beyond it StreamResults answers RESOURCE_EXHAUSTED.")
    retry_after_ms: int = Field(1000, ge=1, le=600_000, description="Back-off suggested with RESOURCE_EXHAUSTED.")
    result_retention_s: int = Field(7 * 86_400, ge=60, le=365 * 86_400, description="Finished prompts and their "
                                    "results are kept this long in Redis (or fewer: max_kept_results).")
    max_kept_results: int = Field(10_000, ge=1, le=10_000_000, description="At most this many finished prompts "
                                  "(and their results) are kept in Redis; the oldest go first. Each holds its answer "
                                  "group: ~2 KB for the CPU demo, num_generations x completion tokens x ~10 bytes "
                                  "for real models, so size it to Redis's memory.")


class RpcSection(Strict):
    """How many calls each gRPC server serves at once, by kind of call, so one kind of caller cannot take the
    threads another needs (common/rpc/call_guard.py). Beyond a limit a call is answered RESOURCE_EXHAUSTED at once;
    every open call holds a server thread. StreamResults calls count against prompts.max_followers."""

    sampler_calls: int = Field(256, ge=1, le=100_000, description="Samplers' rollout and weight-control calls "
                               "(StreamBatches, PushGroup, Admit, ClaimPrompts, GetDataPosition, GetManifest, "
                               "ReportVersion) open at once on one server. A sampler holds about 4 (its rollout "
                               "stream among them): raise it past ~4 x the samplers of a run.")
    weight_fetches: int = Field(64, ge=1, le=100_000, description="FetchSlices calls (bulk weight bytes over gRPC) "
                                "open at once on one server; a sampler's fetch opens weights.fetch_streams of them.")
    prompt_calls: int = Field(32, ge=1, le=100_000, description="Prompt clients' Submit, Cancel and GetStatus calls "
                              "open at once on one server.")
    ops_calls: int = Field(16, ge=1, le=100_000, description="Health Watch streams and reflection calls open at once "
                           "on one server; health Check and List calls have as many slots of their own.")
    calls_per_caller: int = Field(32, ge=1, le=100_000, description="Calls one token (by its name) may have open of "
                                  "each kind above, and at most half of a kind's, so one token cannot take a whole "
                                  "kind. A token shared by N samplers counts as one caller: give each sampler its own "
                                  "(`up` does) or raise this past ~4 x N. Not applied with auth.mode=none (no "
                                  "identities).")
    first_message_timeout_s: float = Field(30.0, gt=0, le=3600, description="A unary call (every RPC but the "
                                           "streams) whose request has not fully arrived this long after the call "
                                           "opened is cancelled, freeing its thread.")
    streams_per_connection: int = Field(128, ge=1, le=100_000, description="HTTP/2 streams (calls) one client "
                                        "connection may have open at once; more wait in the client.")
