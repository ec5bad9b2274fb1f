"""What the vLLM engine refuses before vLLM starts (no vLLM needed): settings vLLM would change silently."""

import pytest

from grpo_stream.common.config.vllm_settings import VllmSection
from grpo_stream.common.engine.vllm_engine import VLLM_MIN_TEMPERATURE, VllmEngine
from grpo_stream.common.runtime.errors import PermanentError


def _engine(temperature: float) -> VllmEngine:
    return VllmEngine("/nonexistent-model-dir", None, 0, [1], 8, 8, temperature, VllmSection())


def test_a_temperature_below_vllms_floor_is_refused_naming_the_field():
    # vLLM raises a temperature below 0.01 to 0.01 (SamplingParams): the sampler's logprobs would be softmax(logits /
    # 0.01) while the trainer recomputes them at the configured temperature
    with pytest.raises(PermanentError, match=r"generation\.temperature=0\.005 is below vLLM's smallest"):
        _engine(0.005)


def test_the_floor_itself_passes_the_check():
    with pytest.raises(Exception) as caught:  # no vLLM here (or no model directory): it fails further on
        _engine(VLLM_MIN_TEMPERATURE)
    assert "generation.temperature" not in str(caught.value)
