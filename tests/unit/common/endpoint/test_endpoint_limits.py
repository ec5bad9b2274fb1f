"""sampler.openai's limits as a config file gives them: the endpoint's share of the engine's slots, the per-token
bound on open requests, and the limits that could never all hold refused at load, naming both fields."""

import pytest

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.serving import endpoint_engine_rows


def test_defaults_leave_the_sampler_half_its_slots_and_one_token_half_the_places():
    cfg = load_config(None, ["generation.decode_slots=64", "sampler.rows_in_flight=64"])
    assert endpoint_engine_rows(cfg) == 32 and cfg.sampler.openai.per_token_limit() == 32
    small = load_config(None, ["generation.decode_slots=8", "sampler.rows_in_flight=8",
                               "sampler.openai.max_engine_share=0.1", "sampler.openai.max_concurrent=1"])
    assert endpoint_engine_rows(small) == 1 and small.sampler.openai.per_token_limit() == 1  # never none at all


@pytest.mark.parametrize("overrides, named", [
    (["sampler.openai.max_n=300"], r"sampler\.openai\.max_n=300 exceeds sampler\.openai\.max_queued=256"),
    (["sampler.openai.max_concurrent_per_token=65"],
     r"sampler\.openai\.max_concurrent_per_token=65 exceeds sampler\.openai\.max_concurrent=64"),
    (["sampler.openai.max_engine_share=0"], r"sampler\.openai\.max_engine_share"),
    (["sampler.openai.max_engine_share=1.5"], r"sampler\.openai\.max_engine_share"),
])
def test_limits_that_cannot_hold_are_refused_at_load_naming_the_fields(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)
