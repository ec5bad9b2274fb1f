"""Reading a run config: a YAML file, then dotted `key.sub=value` overrides, validated into a RunConfig; errors
name the dotted field."""

from __future__ import annotations

import pathlib
from typing import Any

import yaml
from pydantic import ValidationError

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.redact import redacted
from grpo_stream.common.config.schema import RunConfig


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a","b","c"], value); the value is read as YAML (so 3, 0.5, null, true work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not KEY=VALUE with a dotted key (e.g. trainer.steps=20)")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({exc.__class__.__name__})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:i + 1])} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key; remove it or check its spelling (see --print-config for valid keys)")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}" if err["type"] == "value_error" else f"{loc}: {msg} (got {err.get('input')!r})")
    return "; ".join(lines)


def load_config(path: str | pathlib.Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML `path` (or defaults when None), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: top level must be a mapping of sections")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


def to_yaml(cfg: RunConfig, redact: bool = False) -> str:
    """The config as YAML; `redact`: secret-looking values of its free-form dicts hidden (config/redact.py), for
    what a person reads."""
    data = cfg.model_dump(mode="json")
    return yaml.safe_dump(redacted(data) if redact else data, sort_keys=False)
