"""The base of every config section (strict: unknown keys rejected, frozen) and the config error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
