"""Secret-looking values out of what leaves the process for people and services: `config show`, `--print-config`
and the config W&B receives. The config's free-form dicts (task.verifiers.args, sampler.vllm.engine_args, ...) are
where users put an environment's API key or a client's headers; a key whose name says it holds a secret keeps its
name and loses its value, at any depth."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
# a key (snake, kebab or camel case) that names a secret: api_key, apiKey, hf_token, OPENAI_API_KEY, password,
# client-secret, private_key, credentials, Authorization...
_SECRET_KEY = re.compile(r"(?i)(^|[_\-.]|(?<=[a-z]))(api_?key|token|secret|password|passwd|credentials?|"
                         r"private_?key|access_?key|authorization|bearer|cookie)$")


def secret_key(name: str) -> bool:
    return bool(_SECRET_KEY.search(name))


def redacted(value: Any) -> Any:
    """`value` (a config's model_dump) with the value of every secret-looking key replaced by REDACTED."""
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and secret_key(k) and value_ is not None and not isinstance(
            value_, (dict, list)) else redacted(value_) for k, value_ in value.items()}
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value
