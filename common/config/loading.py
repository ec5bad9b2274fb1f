"""Reading a run config: a YAML file, then dotted `key.sub=value` overrides, validated into a RunConfig; errors
name the dotted field."""

from __future__ import annotations

import copy
import pathlib
import re
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.redact import redacted
from grpo_stream.common.config.schema import RunConfig


class _Loader(yaml.SafeLoader):
    """YAML as people write numbers now (YAML 1.2's floats): PyYAML's 1.1 rules read `1e-5` (no point) and `5e-1` as
    strings, which a typed field converts but a free-form one (`sampler.vllm.engine_args`, `task.verifiers.args`)
    would hand on as text."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def read_yaml(text: str) -> Any:
    """`text` parsed as the config's YAML (safe: no tags that build objects; YAML 1.2 floats)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a","b","c"], value); the value is read as YAML (so 3, 0.5, 1e-5, null, true
    work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not KEY=VALUE with a dotted key (e.g. trainer.steps=20)")
    try:
        value = read_yaml(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({exc.__class__.__name__})") from None
    if value is None and raw.strip().startswith("#"):  # YAML reads `# hi` as a comment: it would be null, silently
        raise ConfigError(f"override {key}: value {raw!r} starts with '#', which YAML reads as a comment (null); "
                          f"quote it: {key}='\"{raw}\"'")
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`data` with each dotted override set. A key the file does not set inside a free-form mapping (e.g.
    `task.rewards.answer_format=0.5`) starts from the field's default, so the mapping's other keys stay."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            if part not in node:
                node[part] = _default_mapping(path[:i + 1])
            child = node[part]
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:i + 1])} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def _default_mapping(path: list[str]) -> dict[str, Any]:
    """What a dotted override into `path` starts from when the file does not set it: a copy of the field's default
    when that is a free-form mapping, else {} (a section: its own defaults fill it)."""
    model: Any = RunConfig
    for i, part in enumerate(path):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return {}
        if i == len(path) - 1:
            default = field.get_default(call_default_factory=True)
            return copy.deepcopy(default) if isinstance(default, dict) else {}
        model = _section_of(field.annotation)
    return {}


def _section_of(annotation: Any) -> Any:
    """The pydantic section an annotation holds (`Section`, `Section | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)), None)


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
            loaded = read_yaml(path.read_text())
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
