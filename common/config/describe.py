"""`grpo-stream config describe`: every config field with its type, default, limits and documentation.

Read from the pydantic models themselves (common/config/), so it cannot drift from what the loader accepts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

_LIMITS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "<="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.MinLen, "min_length", "min length"),
           (annotated_types.MaxLen, "max_length", "max length"))


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    name: str  # dotted, as an override names it: trainer.steps
    type: str
    default: Any
    limits: tuple[str, ...]
    doc: str


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a constrained item (list[Annotated[int, Ge(0)]]): its type; limits are per field
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _section(annotation: Any) -> type[BaseModel] | None:
    """The config section class a field holds, if it holds one (possibly optional)."""
    candidates = typing.get_args(annotation) or (annotation,)
    for a in candidates:
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def fields(model: type[BaseModel], prefix: str = "") -> list[FieldDoc]:
    """Every leaf field of `model` and its sections, in declaration order."""
    out: list[FieldDoc] = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        section = _section(info.annotation)
        if section is not None and typing.get_origin(info.annotation) is None:
            out.extend(fields(section, dotted + "."))
            continue
        optional = section is not None and set(typing.get_args(info.annotation)) == {section, type(None)}
        limits = tuple(f"{word} {getattr(m, attr)}" for m in info.metadata for cls, attr, word in _LIMITS
                       if isinstance(m, cls))
        if info.default_factory is not None:
            default = info.default_factory()
        else:
            default = None if info.default is PydanticUndefined else info.default
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        out.append(FieldDoc(dotted, _type_name(info.annotation), default, limits, " ".join((info.description or
                                                                                            "").split())))
        if optional:  # a section that is off by default (null): its fields, as set once it is given
            out.extend(fields(section, dotted + "."))
    return out


def describe(model: type[BaseModel], prefix: str = "") -> str:
    """Plain text, one block per field whose dotted name starts with `prefix` (all when empty)."""
    docs = [f for f in fields(model) if f.name.startswith(prefix)]
    if not docs:
        raise ValueError(f"no config field starts with {prefix!r}; `grpo-stream config describe` lists them all")
    blocks = []
    for f in docs:
        head = f"{f.name}: {f.type} = {f.default!r}" + (f"  ({', '.join(f.limits)})" if f.limits else "")
        blocks.append(head + (f"\n    {f.doc}" if f.doc else ""))
    return "\n".join(blocks) + "\n"
