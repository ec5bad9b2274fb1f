"""sampler.vllm's checks: an engine argument the engine sets itself is refused naming where a run sets it."""

import pydantic
import pytest

from grpo_stream.common.config.vllm_settings import VllmSection


@pytest.mark.parametrize("arg,where", [("max_model_len", "generation.max_prompt_tokens + generation.max_new_tokens"),
                                       ("dtype", "sampler.dtype"), ("seed", "run.seed"),
                                       ("enable_prefix_caching", "sampler.vllm.prefix_caching"),
                                       ("load_format", "nowhere (the engine's own)")])
def test_a_reserved_engine_arg_names_the_setting_that_sets_it(arg, where):
    with pytest.raises(pydantic.ValidationError) as caught:
        VllmSection(engine_args={arg: 1})
    message = str(caught.value)
    assert f"sampler.vllm.engine_args sets ['{arg}']" in message
    assert f"{arg}: {where}" in message
    assert "use the sampler.vllm fields" not in message  # there is no sampler.vllm field for most of them


def test_other_engine_args_pass_to_vllm():
    assert VllmSection(engine_args={"swap_space": 0}).engine_args == {"swap_space": 0}
