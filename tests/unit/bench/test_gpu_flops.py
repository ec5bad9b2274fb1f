"""`bench gpu trainer`'s model FLOPs (its TFLOP/s and MFU): exactly the passes the updater runs over the batch."""

import dataclasses

import pytest

from grpo_stream.bench.gpu import model_flops_per_token, update_flops, update_passes
from grpo_stream.common.config.learning import AlgoSection, ModelSection
from grpo_stream.common.model.policy import build_model
from grpo_stream.trainer_service.learning.packing import one_sequence_per_row
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

TOKENS, CONTEXT = 8 * 12, 12


@pytest.fixture(scope="module")
def model():
    return build_model(ModelSection(), 160, seed=0)


def flops_of(model, teacher_arch=None, **algo) -> float:
    """The bench's count for an updater built as the bench builds it, with `algo` settings."""
    updater = PolicyUpdater(model, model.params, AlgoSection(**algo), 1e-3, 1.0, 1.0, 0,
                            one_sequence_per_row(4, CONTEXT, 8, 8))
    return update_flops(model.arch, TOKENS, CONTEXT, update_passes(updater), teacher_arch)


@pytest.mark.parametrize("algo, forward_passes, train_passes", [
    ({"beta": 0.0}, 0, 1),                       # no reference model: the update alone
    ({"beta": 0.08}, 1, 1),                      # + the reference model's forward
    ({"beta": 0.0, "minibatches": 2}, 1, 1),     # + the old logprobs' forward (the minibatches split one pass)
    ({"beta": 0.08, "num_iterations": 2}, 2, 2),  # two passes, the old logprobs and the reference
])
def test_flops_count_the_forward_passes_the_update_runs(model, algo, forward_passes, train_passes):
    train = TOKENS * model_flops_per_token(model.arch, CONTEXT, True)
    forward = TOKENS * model_flops_per_token(model.arch, CONTEXT, False)
    assert flops_of(model, **algo) == pytest.approx(train_passes * train + forward_passes * forward)


def test_a_distillation_teachers_forward_counts_at_the_teachers_shape(model):
    teacher = dataclasses.replace(model.arch, num_layers=2 * model.arch.num_layers, embed_dim=2 * model.arch.embed_dim)
    passes = {"train": 1, "old_logprobs": 0, "reference": 0, "teacher": 1}
    assert update_flops(model.arch, TOKENS, CONTEXT, passes, teacher) == pytest.approx(
        TOKENS * (model_flops_per_token(model.arch, CONTEXT, True) + model_flops_per_token(teacher, CONTEXT, False)))
