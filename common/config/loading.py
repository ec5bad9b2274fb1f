"""Reading a run config: a YAML file, then dotted `key.sub=value` overrides, validated into a RunConfig; errors
name the dotted field."""

from __future__ import annotations

import copy
import difflib
import json
import pathlib
import reprlib
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.redact import redacted
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.config.yaml_text import dropped_comment, dump_yaml, one_line, read_yaml

# the deepest a value may nest under the top of the config: a real one holds under ten levels; pydantic's printing
# of a config gives up at a few hundred
MAX_DEPTH = 64
__all__ = ["apply_overrides", "load_config", "parse_override", "read_yaml", "redacted_override", "to_yaml"]


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a","b","c"], value); the value is read as YAML (so 3, 0.5, 1e-5, null, true
    work)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not KEY=VALUE with a dotted key (e.g. trainer.steps=20)")
    try:
        value = read_yaml(raw) if raw else ""
        comment = dropped_comment(raw) if "#" in raw else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {_SHORT.repr(raw)} is not valid YAML at {one_line(exc)}") from None
    except RecursionError:
        raise ConfigError(f"override {key}: value nested too deeply to read as a config value") from None
    if value is None and raw.strip().startswith("#"):  # YAML reads `# hi` as a comment: it would be null, silently
        raise ConfigError(f"override {key}: value {raw!r} starts with '#', which YAML reads as a comment (null); "
                          f"quote it: {key}='\"{raw}\"'")
    if comment is not None:  # `task.system_prompt=Answer with #### N` was 'Answer with', silently
        raise ConfigError(f"override {key}: YAML reads {comment!r} in value {raw!r} as a comment and would drop it; "
                          f"quote the value: {key}='\"{raw}\"'")
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`data` with each dotted override set. A key the file does not set inside a free-form mapping (e.g.
    `task.rewards.answer_format=0.5`) starts from the field's default, so the mapping's other keys stay; so does a
    section the file leaves empty or null (`model.lora: null`, then `model.lora.rank=8`). A mapping's default is the
    one its section resolves from the rest of the config, every override in: `task.name=ifeval` has rewards of its
    own, so `task.name=ifeval task.rewards.ifeval_loose=0.5` keeps ifeval_strict (it was answer_correct's and
    answer_format's, which score no IFEval reply), whichever comes first."""
    started: set[tuple[str, ...]] = set()
    draft = _apply(copy.deepcopy(data), overrides, _default_mapping, started)
    resolved = {path: _resolved_default(draft, path, started) for path in started}

    def default(path: list[str]) -> dict[str, Any] | None:
        found = resolved.get(tuple(path))
        return copy.deepcopy(found) if found is not None else _default_mapping(path)
    return _apply(data, overrides, default, set())


def _apply(data: dict[str, Any], overrides: list[str], default: Any, started: set[tuple[str, ...]]) -> dict[str, Any]:
    """`data` with each override set, a mapping the data does not hold starting from `default(path)`; the paths of
    the free-form mappings started from their field's default are added to `started`."""
    for text in overrides:
        path, value = parse_override(text)
        path = _key_of_flat_mapping(path)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = default(path[:i + 1])
                if child is None:
                    raise ConfigError(_not_a_section(text, path[:i + 1]))
                if _free_form(path[:i + 1]):
                    started.add(tuple(path[:i + 1]))
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(_not_a_section(text, path[:i + 1], child))
            node = child
        node[path[-1]] = value
    return data


def _key_of_flat_mapping(path: list[str]) -> list[str]:
    """`path` with what follows a mapping of plain values (task.rewards, hardware.trainer_env) joined as its one key:
    such a mapping holds no mappings, and its keys may hold dots (`task.rewards.mypkg.rewards:score=0.5`, a reward
    'package.module:function', was read as a mapping `mypkg` and refused as 'task.rewards.mypkg: Input should be a
    valid number')."""
    for i in range(1, len(path) - 1):
        if _flat_mapping(path[:i]):
            return [*path[:i], ".".join(path[i:])]
    return path


def _flat_mapping(path: list[str]) -> bool:
    """Whether `path` names a mapping field whose values are plain values (numbers, text), not mappings."""
    field = getattr(_model_at(path[:-1]), "model_fields", {}).get(path[-1])
    if field is None or typing.get_origin(field.annotation) is not dict:
        return False
    item = typing.get_args(field.annotation)[-1]
    return item in (str, int, float, bool)


def _not_a_section(text: str, path: list[str], value: Any = None) -> str:
    """The message for an override that goes into a value (`trainer.steps.x=1`, `eval.ks.0=5`)."""
    dotted = ".".join(path)
    field = getattr(_model_at(path[:-1]), "model_fields", {}).get(path[-1])
    kinds = {typing.get_origin(a) for a in (field.annotation, *typing.get_args(field.annotation))} if field else set()
    listed = isinstance(value, list) or list in kinds
    fix = f"; an override sets a list whole, as {dotted}='[...]'" if listed else ""
    return f"override {text!r}: {dotted} is a value, not a section{fix}"


def _resolved_default(draft: dict[str, Any], path: tuple[str, ...], started: set[tuple[str, ...]]) -> Any:
    """The value the section holding free-form mapping `path` gives it when the config does not (a before-validator
    may choose it from the section's other keys), with the rest of the section as `draft` sets it; the field's own
    default when the section does not validate (the whole config's validation then says why)."""
    parent: Any = draft
    for part in path[:-1]:
        parent = parent.get(part) if isinstance(parent, dict) else None
    model = _model_at(path[:-1])
    if not isinstance(parent, dict) or model is None:
        return _default_mapping(list(path))
    rest = {key: value for key, value in parent.items() if (*path[:-1], key) not in started}
    try:
        found = getattr(model.model_validate(rest), path[-1])
    except ValueError:  # pydantic's ValidationError included
        return _default_mapping(list(path))
    return copy.deepcopy(found) if isinstance(found, dict) else _default_mapping(list(path))


def _model_at(path: tuple[str, ...] | list[str]) -> Any:
    """The config section class at dotted `path` (RunConfig for the top), or None where no section is."""
    model: Any = RunConfig
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        model = _section_of(field.annotation) if field is not None else None
    return model


def _free_form(path: list[str]) -> bool:
    """Whether `path` names a mapping field of a section (`task.rewards`), not a section nor a key it lacks."""
    field = getattr(_model_at(path[:-1]), "model_fields", {}).get(path[-1])
    return field is not None and _section_of(field.annotation) is None


def _default_mapping(path: list[str]) -> dict[str, Any] | None:
    """What a dotted override into `path` starts from when the file does not set it: a copy of the field's default
    when that is a free-form mapping, {} for a section (its own defaults fill it) or a key the schema does not have
    (validation names it), None for a field that holds a value."""
    model: Any = RunConfig
    for i, part in enumerate(path):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return {}
        if i == len(path) - 1:
            if _section_of(field.annotation) is not None:
                return {}
            default = field.get_default(call_default_factory=True)
            if isinstance(default, dict) or typing.get_origin(field.annotation) is dict:
                return copy.deepcopy(default) if isinstance(default, dict) else {}
            return None
        model = _section_of(field.annotation)
    return {}


def _section_of(annotation: Any) -> Any:
    """The pydantic section an annotation holds (`Section`, `Section | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)), None)


def _short_repr() -> reprlib.Repr:
    """repr for an error message: long strings, lists and mappings cut (a value pasted whole, or aliases' output)."""
    short = reprlib.Repr()  # keyword limits need Python 3.12
    short.maxstring, short.maxother, short.maxlist, short.maxdict, short.maxlevel = 80, 80, 6, 6, 3
    return short


_SHORT = _short_repr()
_YAML_TYPES = {bool: "a boolean (true/false, yes/no, on/off)", int: "a number", float: "a number", dict: "a mapping "
               "(`key: value`)", list: "a list"}


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """The message for a key the section at loc[:-1] does not have, with the nearest field it does have."""
    model: Any = RunConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        model = _section_of(field.annotation) if field is not None else None
    dotted = ".".join(str(p) for p in loc)
    close = difflib.get_close_matches(str(loc[-1]), list(getattr(model, "model_fields", {})), n=1, cutoff=0.75)
    if close:
        nearest = ".".join([*(str(p) for p in loc[:-1]), close[0]])
        return f"{dotted}: unknown key; did you mean {nearest}? (see --print-config for valid keys)"
    return f"{dotted}: unknown key; remove it or check its spelling (see --print-config for valid keys)"


def _key_not_text(err: Any) -> str:
    """The message for a key YAML read as another type than text (`NO: 1` under hardware.trainer_env, `on:` in a
    section): pydantic's named the key's position as a field (`hardware.trainer_env.0.[key]`, the boolean as 0)."""
    parent = err["loc"][:-1] if err["type"] == "invalid_key" else err["loc"][:-2]
    where = ".".join(str(p) for p in parent) or "the top level"
    got = err.get("input")
    read_as = "null (null, ~ or nothing)" if got is None else _YAML_TYPES.get(type(got), type(got).__name__)
    return (f"{where}: key {_SHORT.repr(got)} is not text: YAML read the key as {read_as}; quote it as written in "
            "the file (e.g. 'no': ...)")


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key(err["loc"]))
        elif err["type"] == "model_type" and err.get("input") is None:
            lines.append(f"{loc}: is empty (null), but it is a section; give it keys or remove it (its defaults "
                         "apply)")
        elif err["type"] == "value_error":
            lines.append(f"{loc}: {msg}" if err["loc"] else msg)  # a check across sections names its fields
        elif err["type"] == "invalid_key" or err["loc"][-1:] == ("[key]",):
            lines.append(_key_not_text(err))
        elif err["type"] == "string_type" and err.get("input") is not None:
            got = err["input"]
            read_as = _YAML_TYPES.get(type(got), type(got).__name__)
            lines.append(f"{loc}: {msg} (got {_SHORT.repr(got)}: YAML read the value as {read_as}); quote it, as "
                         f"{loc}='\"...\"' or in the file {err['loc'][-1]}: '...'")
        else:
            lines.append(f"{loc}: {msg} (got {_SHORT.repr(err.get('input'))})")
    return "; ".join(lines)


def _read_file(path: pathlib.Path) -> dict[str, Any]:
    """The mapping a config file holds, or a ConfigError naming the file and what is wrong with it."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"--config {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} on line {line}); "
                          "save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    try:
        loaded = read_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML at {one_line(exc)}") from None
    except RecursionError:
        raise ConfigError(f"--config {path}: nested too deeply to read as a config") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"--config {path}: top level must be a mapping of sections (got {type(loaded).__name__})")
    return loaded or {}


def _refuse_deep(data: dict[str, Any]) -> None:
    """Refuse a value nested more than MAX_DEPTH levels (a file's `[[[...]]]`, an override `args.a.b.c...=1`): it
    validated, then every printing of the config failed with pydantic's 'Maximum serialization depth exceeded' and a
    traceback naming no field (`config show`, the run's config.yaml at `up`)."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if len(path) > MAX_DEPTH:
            shown = ".".join(str(p) for p in path[:4])
            raise ConfigError(f"{shown}: nested more than {MAX_DEPTH} levels deep; a config value holds a few levels "
                              "of mappings and lists: flatten it")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend(((*path, key), item) for key, item in items)


def load_config(path: str | pathlib.Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML `path` (or defaults when None), apply dotted overrides, validate."""
    data = _read_file(pathlib.Path(path)) if path is not None else {}
    _refuse_deep(data)  # before apply_overrides copies it (copy.deepcopy recurses)
    data = apply_overrides(data, overrides or [])
    _refuse_deep(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


def to_yaml(cfg: RunConfig, redact: bool = False) -> str:
    """The config as YAML; `redact`: secret-looking values of its free-form dicts hidden (config/redact.py), for
    what a person reads."""
    data = cfg.model_dump(mode="json")
    return dump_yaml(redacted(data) if redact else data)  # strings YAML would read as numbers quoted: reads back same


def redacted_override(text: str) -> str:
    """A dotted override as a person may read it: a secret-named key's value hidden, as `to_yaml(redact=True)` hides
    it, also inside a mapping or list value (`task.verifiers.args={api_key: sk-...}`)."""
    try:
        path, value = parse_override(text)
    except ConfigError:
        return text
    # the rule to_yaml(redact=True) applies, the names of the keys above included (`args.api_keys.openai=sk-...`)
    shown: Any = value
    for part in reversed(path):
        shown = {part: shown}
    shown = redacted(shown)
    for part in path:
        shown = shown[part]
    if shown == value:
        return text
    return f"{'.'.join(path)}={shown if isinstance(shown, str) else json.dumps(shown)}"
