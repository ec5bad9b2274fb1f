"""What each child of `grpo-stream up` is handed to authenticate: the run's token table and tokens, and the embedded
Redis's password; and the overrides `up` records, their secret values hidden. Secrets travel in the environment or
in 0600 files, never on a command line (`ps` shows those to every user of the machine)."""

from __future__ import annotations

import hashlib
import pathlib

import yaml

from grpo_stream.common.config.access import REDIS_PASSWORD_ENV, TOKEN_ENV, TOKEN_FILE_ENV, TOKENS_ENV
from grpo_stream.common.config.loading import redacted_override
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis
from grpo_stream.common.rpc.auth import write_private, write_tokens
from grpo_stream.up.relay import say_now


def with_run_tokens(cfg: RunConfig, run_dir: pathlib.Path, env: dict[str, str]) -> tuple[dict, dict, str]:
    """(servers' env, samplers' env, client token file or ''). With auth.mode=tokens and no token table given, the
    run gets its own in RUN_DIR/auth (kept, so a resumed run and its clients keep their tokens): servers read the
    table, each sampler its own token (`sampler_token_env`); `grpo-stream submit --run-dir` finds the client token
    there."""
    if cfg.auth.mode == "none" or env.get(TOKENS_ENV) or cfg.auth.tokens_file:
        return env, dict(env), ""
    auth_dir = (run_dir / "auth").resolve()
    if not (auth_dir / "tokens.yaml").is_file():
        write_tokens(auth_dir, samplers=cfg.sampler.replicas)
        say_now(f"[up] made this run's tokens in {auth_dir} (client token: {auth_dir / 'client.token'})")
    samplers = {k: v for k, v in env.items() if k != TOKEN_ENV}
    samplers[TOKEN_FILE_ENV] = str(auth_dir / "sampler.token")
    if cfg.sampler.openai.port is not None:  # the samplers' endpoints check client tokens: by digest only
        samplers[TOKENS_ENV] = str(endpoint_table(auth_dir))
    return {**env, TOKENS_ENV: str(auth_dir / "tokens.yaml")}, samplers, str(auth_dir / "client.token")


def endpoint_table(auth_dir: pathlib.Path) -> pathlib.Path:
    """RUN_DIR/auth/endpoint-tokens.yaml: the run's table as SHA-256 digests, for the samplers' OpenAI-compatible
    endpoints. A sampler holds only its own token otherwise; it never gets another token that it could present
    elsewhere. The sampler entries are there so that a sampler's token is answered 403 (a known token of a role the
    routes refuse), not 401 as an unknown one."""
    rows = yaml.safe_load((auth_dir / "tokens.yaml").read_text())
    kept = [{"name": r["name"], "role": r["role"], "sha256": hashlib.sha256(r["token"].encode()).hexdigest()}
            for r in rows if r["role"] in ("client", "admin", "sampler") and "token" in r]
    path = auth_dir / "endpoint-tokens.yaml"
    write_private(path, yaml.safe_dump(kept, sort_keys=False))
    return path


def with_redis_password(server_env: dict[str, str], sampler_env: dict[str, str], redis_server: EmbeddedRedis | None
                        ) -> tuple[dict[str, str], dict[str, str]]:
    """(servers' env, samplers' env) with the embedded Redis's password: in the environment of the processes that
    use Redis (trainer, ingest), as the URL is in their overrides; samplers never talk to Redis and get none."""
    if redis_server is None:
        return server_env, sampler_env
    return ({**server_env, REDIS_PASSWORD_ENV: redis_server.password},
            {k: v for k, v in sampler_env.items() if k != REDIS_PASSWORD_ENV})


def sampler_token_env(env: dict[str, str], index: int) -> dict[str, str]:
    """Sampler `index`'s environment: its own token (sampler-<index>.token beside the shared one, when the run made
    one: it can send only as its own id) or else the shared sampler token."""
    shared = env.get(TOKEN_FILE_ENV)
    own = pathlib.Path(shared).with_name(f"sampler-{index}.token") if shared else None
    return {**env, TOKEN_FILE_ENV: str(own)} if own is not None and own.is_file() else env


def redacted_overrides(overrides: list[str]) -> list[str]:
    """`overrides` (KEY=VALUE) with the value of each secret-named key hidden, as `to_yaml(redact=True)` hides it,
    inside a mapping or list value too (`task.verifiers.args={api_key: sk-...}`)."""
    return [redacted_override(override) for override in overrides]


def command_line_secrets(overrides: list[str]) -> list[str]:
    """The keys among `overrides` whose values are secrets (as `redacted_overrides` hides them). `up`'s command line,
    and the same overrides on its children's, are readable by every user of the machine (`ps`) for the whole run;
    `up` cannot hide what its own command line shows, so it warns (`secrets_warning`)."""
    return [o.partition("=")[0] for o in overrides if redacted_override(o) != o]


def secrets_warning(overrides: list[str]) -> str | None:
    """`up`'s warning naming the secret-carrying overrides, or None when there are none."""
    keys = command_line_secrets(overrides)
    if not keys:
        return None
    return (f"[up] warning: {', '.join(keys)} given on the command line, where `ps` shows it to every user of this "
            "machine (on `up`'s command line and on each process it starts); put it in a config file only you can "
            "read (--config, mode 0600) instead")
