"""Secret-looking values out of what leaves the process for people and services: `config show`, `--print-config`
and the config W&B receives. The config's free-form dicts (task.verifiers.args, sampler.vllm.engine_args, ...) are
where users put an environment's API key or a client's headers; a key whose name says it holds a secret keeps its
name and loses its value, at any depth."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
# a key (snake, kebab or camel case) that names a secret: api_key, apiKey, hf_token, OPENAI_API_KEY, password,
# client-secret, private_key, credentials, Authorization, the headers x-api-key and api-key, SECRET_KEY...
_SECRET_KEY = re.compile(r"(?i)(^|[_\-.]|(?<=[a-z]))(api[_-]?keys?|token|secret|password|passwd|passphrase|"
                         r"credentials?|(private|access|secret|signing|encryption)[_-]?key|authorization|bearer|"
                         r"cookie)$")


def secret_key(name: str) -> bool:
    return bool(_SECRET_KEY.search(name))


def redacted(value: Any) -> Any:
    """`value` (a config's model_dump) with the value of every secret-looking key replaced by REDACTED."""
    if isinstance(value, dict):
        return {k: _hidden(v) if isinstance(k, str) and secret_key(k) else redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value


def _hidden(value: Any) -> Any:
    """The value of a secret-named key: REDACTED, each item of a list (`api_keys: [k1, k2]`) too; a mapping keeps
    its keys, and names its secrets (`credentials: {user: u, password: p}`: the secret-named ones are hidden) or
    holds nothing else (`api_keys: {openai: sk-..., anthropic: sk-...}`: every value hidden; they were printed and
    sent to W&B); null stays null (unset)."""
    if isinstance(value, dict):
        if any(isinstance(k, str) and secret_key(k) for k in value):
            return redacted(value)
        return {k: _hidden(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hidden(v) for v in value]
    return None if value is None else REDACTED
