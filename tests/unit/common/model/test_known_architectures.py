"""The presets' checkpoints sized without their files: the published parameter counts come out of the shapes."""

import pytest

from grpo_stream.common.model.known_architectures import known_architecture
from grpo_stream.common.model.policy import build_from_architecture


@pytest.mark.parametrize("name, parameters", [
    ("/models/Llama-3.1-8B-Instruct", 8_030_261_248), ("meta-llama/Llama-3.1-70B", 70_553_706_496),
    ("Llama-3.2-1B-Instruct", 1_235_814_400), ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768),
    ("/models/Qwen2.5-1.5B-Instruct/", 1_543_714_304), ("qwen2.5-7b", 7_615_616_512)])
def test_known_checkpoints_have_their_published_parameter_counts(name, parameters):
    arch = known_architecture(name)
    assert build_from_architecture(arch, None).num_params() == parameters


def test_an_unknown_name_is_none():
    assert known_architecture("/models/my-finetune") is None
