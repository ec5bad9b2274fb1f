"""The update's importance-sampling diagnostics: every layout (one sequence a row in one pass or in passes of 4,
packed rows) and minibatch split hands the host exactly the per-token o - b a plain forward pass of the step's
starting weights over the padded rows gives, so the
diagnostics are those of off_policy_health.importance_diagnostics on that (its arithmetic is tested by hand in
test_off_policy_health.py)."""

import jax
import numpy as np
import pytest

from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.off_policy_health import group_index_of, importance_diagnostics
from grpo_stream.trainer_service.learning.packing import (PackingLayout, one_sequence_per_row, packing_layout,
                                                 segments_per_row)
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from tests.unit.trainer_service.learning.test_rl_update import rollout  # noqa: F401 - fixture

LAYOUTS = ("one-a-row", "one-a-row-passes-of-4", "packed")


def stale_batch(tiny_parts, groups, algo):
    """The rollout's batch with behaviour logprobs as a sampler some versions behind would have them: off the
    trainer's by a different amount on every token (both signs, some far enough to be truncated at tis_cap=2)."""
    cfg, _, tok, _ = tiny_parts
    batch, _ = build_batch(groups, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, tok.pad_id, algo,
                           held_version=0)
    shift = np.random.default_rng(7).normal(0.0, 0.5, batch.loss_mask.shape).astype(np.float32)
    return batch.replace(behaviour_logprobs=batch.behaviour_logprobs + shift * batch.loss_mask)


# the default lane takes one split per layout; -m heavy the other three
CASES = [pytest.param(layout, minibatches,
                      marks=() if (layout == "one-a-row") == (minibatches == 1) else pytest.mark.heavy)
         for layout in LAYOUTS for minibatches in (1, 2)]


@pytest.mark.parametrize("layout,minibatches", CASES)
def test_the_update_reports_the_diagnostics_of_its_starting_policy(tiny_parts, rollout, layout, minibatches):  # noqa: F811
    cfg, _, tok, model = tiny_parts
    gen = cfg.generation
    algo = AlgoSection(tis_cap=2.0, minibatches=minibatches)
    batch = stale_batch(tiny_parts, rollout, algo)
    row, sequences = gen.max_prompt_tokens + gen.max_new_tokens, batch.tokens.shape[0] // minibatches
    rows = {"one-a-row": one_sequence_per_row(gen.max_prompt_tokens, row, sequences, sequences),
            "one-a-row-passes-of-4": one_sequence_per_row(gen.max_prompt_tokens, row, 4, sequences),
            "packed": PackingLayout(gen.max_prompt_tokens, row, 4, segments_per_row(row), -(-sequences // 4))}
    updater = PolicyUpdater(model, model.params, algo, 1e-3, 1.0, gen.temperature, tok.pad_id, rows[layout])
    start = np.asarray(sequence_logprobs(model, model.params, batch.tokens, batch.valid, gen.temperature,
                                         tok.pad_id))
    mask = np.asarray(batch.loss_mask)
    groups = group_index_of(rollout)
    expected = importance_diagnostics((start - np.asarray(batch.behaviour_logprobs)) * mask, mask, groups, 2.0)
    got = updater.update(batch, groups)
    assert 0.0 < expected["is_truncated_fraction"] < 0.5 and expected["is_ess_token"] < 0.9  # the batch is off-policy
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # without the groups (the other processes of a multi-process trainer) nothing of it is computed
    assert "is_ess_token" not in updater.update(batch)


def test_clip_fractions_low_and_high_add_up(tiny_parts, rollout):  # noqa: F811
    """Two minibatches of GRPO: the second's token ratios leave the clip band on both sides, and each clipped token
    is counted on exactly one side."""
    cfg, _, tok, model = tiny_parts
    algo = AlgoSection(minibatches=2, epsilon=0.01, epsilon_high=0.02)
    batch = stale_batch(tiny_parts, rollout, algo)
    updater = PolicyUpdater(model, model.params, algo, 1e-2, 1.0, cfg.generation.temperature, tok.pad_id,
                            packing_layout(cfg, 1))
    m = updater.update(batch)
    assert m["clip_fraction_low"] > 0 and m["clip_fraction_high"] > 0
    assert m["clip_fraction_low"] + m["clip_fraction_high"] == pytest.approx(m["clip_fraction"], rel=1e-6)
    jax.clear_caches()
