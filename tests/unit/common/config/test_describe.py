"""`grpo-stream config describe`: every field, from the schema itself, with type, default, limits and doc."""

import pytest

from grpo_stream.cli import main
from grpo_stream.common.config.describe import describe, fields
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import RunConfig


def leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("rewards", "engine_args"):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_every_leaf_of_the_defaults_is_described_with_a_doc():
    docs = {f.name: f for f in fields(RunConfig)}
    assert set(leaves(load_config(None, []).model_dump(mode="json"))) <= set(docs)
    undocumented = [name for name, f in docs.items() if not f.doc]
    assert not undocumented, undocumented


def test_a_field_shows_its_type_default_limits_and_doc(capsys):
    assert main(["config", "describe", "trainer.steps"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trainer.steps: int = 60  (>= 1, <= 10000000)\n    RL optimizer steps to run.")
    assert "sampler.engine: str = 'jax'" in describe(RunConfig, "sampler.engine")
    assert describe(RunConfig, "eval.ks").startswith("eval.ks: list[int] = [1]")  # not pydantic's Annotated repr
    with pytest.raises(ValueError, match="no config field starts with 'nope'"):
        describe(RunConfig, "nope")


def test_the_fields_of_a_section_that_is_off_by_default_are_described_too():
    """model.lora is null by default: its fields were left out, though docs/lora.md sends users to them."""
    docs = {f.name for f in fields(RunConfig)}
    assert set(leaves(load_config(None, ["model.lora.rank=8"]).model_dump(mode="json"))) <= docs
    assert {"model.lora", "model.lora.rank", "model.lora.alpha", "model.lora.targets"} <= docs
