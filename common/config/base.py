"""The base of every config section (strict: unknown keys rejected, frozen, no boolean taken as a number) and the
config error type."""

from __future__ import annotations

import os
import types
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


def _expand_home(path: str | None) -> str | None:
    """A leading ~ expanded as a shell would: YAML values and dotted overrides (`key.sub=~/x`, where bash leaves the
    ~ alone) reach the process unexpanded, and the file was then looked for under a directory named ~."""
    return os.path.expanduser(path) if path is not None else None


# a file or directory the config names (null allowed): a leading ~ expands; gs:// and other URLs are left alone
FilePath = Annotated[str | None, AfterValidator(_expand_home)]


def _is_number(annotation: Any) -> bool:
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation in (int, float)


def number_slots(annotation: Any) -> str | None:
    """Where a field's type holds numbers: 'value' (int, float, either or null), 'items' (a list of them, or a
    mapping to them), else None."""
    if _is_number(annotation):
        return "value"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, dict) and args and _is_number(args[-1]):
        return "items"
    if origin in (typing.Union, types.UnionType):
        if bool in args:
            return None
        return next((slot for slot in map(number_slots, args) if slot is not None), None)
    return None


def _boolean_in(value: Any, slots: str | None) -> Any:
    """The first boolean where `slots` says numbers go, else None."""
    if slots == "value" and isinstance(value, bool):
        return value
    if slots == "items":
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        return next((item for item in items if isinstance(item, bool)), None)
    return None


class Strict(BaseModel):
    # no inf or nan in a number field: `algo.advantage_eps=.inf` zeroed every advantage, `.nan` poisons a step. A
    # free-form value (task.verifiers.args) may be one: dumped as a float, not null (pydantic's default), so `config
    # show`, RUN_DIR/config.yaml and plan's copy of the config hold the value the run uses
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, ser_json_inf_nan="constants")

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads true as 1 and false as 0 for a number, and YAML reads yes/no/on/off as booleans: so
        `metrics_port: off` meant a free port (0) rather than none (null), and `trainer.steps=true` one step."""
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        slots = number_slots(annotation)
        found = _boolean_in(value, slots)
        if found is not None:
            nullable = slots == "value" and type(None) in typing.get_args(annotation)
            raise ValueError(f"got {found!r}, a boolean (YAML reads true/false, yes/no and on/off as booleans), "
                             f"where a number belongs; give the number meant"
                             + (", or null to turn it off" if nullable else ""))
        return value


def dotted_settings(data: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a config's nested mappings (a list, or an empty mapping, is one value under its own
    key): what `up` compares between two records of a run's config, and what a multi-host trainer's processes
    compare between them."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(dotted_settings(value, name))
        else:
            out[name] = value
    return out
