"""GSPO's update on stale sequences (drawn 2-3 versions behind), against a reference written out token by token.

The trainer's GSPO objective (PolicyUpdater.objective with loss_algo=gspo-token and the config's own clip) follows
the GSPO paper: the sequence ratio s_i = exp(mean_t (l_it - b_it)) against the sampler's policy b that drew the
sequence, clipped at [1 - 3e-4, 1 + 4e-4], no further importance weight. GSPO-token's per-token ratio is
exp(l - sg(l) + sg(s_i)), so d rho_it / d l_it = s_i, and a sequence whose clipped term is taken has no gradient.
The reference below computes loss and gradient with plain Python loops from those definitions.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.trainer_service.learning.loss import policy_loss, truncated_is_weights
from grpo_stream.trainer_service.learning.packing import packing_layout
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

# Four sequences drawn by a sampler 2-3 versions behind; o = the trainer's weights at the step's start, l = after
# the step's first optimizer update (its second minibatch). The policy has moved since the sampler drew them:
#   0: A > 0, the policy moved away from it (s < 1 - eps_low): trained, pulled back up
#   1: A < 0, the policy moved towards it (s > 1 + eps_high): trained, pushed down
#   2: A > 0, the policy already moved towards it (s > 1 + eps_high): clipped, no gradient
#   3: A < 0, the policy already moved away (s < 1 - eps_low), 2 tokens in the mask: clipped, no gradient
L = [[-0.60, -1.30, -0.20, -2.10], [-0.50, -0.90, -0.10, -0.70], [-0.20, -0.30, -0.40, -0.10], [-1.9, -2.2, 0, 0]]
O = [[-0.55, -1.25, -0.15, -2.05], [-0.55, -0.95, -0.15, -0.75], [-0.25, -0.35, -0.45, -0.15], [-1.7, -2.0, 0, 0]]
B = [[-0.50, -1.20, -0.10, -2.00], [-0.60, -1.00, -0.20, -0.80], [-0.30, -0.40, -0.50, -0.20], [-1.5, -1.8, 0, 0]]
M = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
A = [1.5, -0.5, 1.0, -1.0]
EPS_LOW, EPS_HIGH = 3e-4, 4e-4  # CLIP_DEFAULTS["gspo-token"]


def reference():
    """(loss, d loss / d l) of GSPO-token against the behaviour policy, token-mean aggregation."""
    tokens = sum(map(sum, M))
    loss, grad = 0.0, [[0.0] * 4 for _ in L]
    for i, (l_i, b_i, m_i, a) in enumerate(zip(L, B, M, A)):
        s = math.exp(sum((l - b) * m for l, b, m in zip(l_i, b_i, m_i)) / sum(m_i))
        clipped = min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH)
        for t in range(4):
            if m_i[t]:
                loss += max(-a * s, -a * clipped) / tokens
                grad[i][t] = 0.0 if -a * clipped > -a * s else -a * s / tokens
    return loss, np.array(grad)


def test_gspo_on_stale_sequences_matches_the_reference_loss_and_gradient(tiny_parts):
    cfg, _, tok, model = tiny_parts
    algo = AlgoSection(loss_algo="gspo-token", minibatches=2)  # the clip is the loss's own
    assert (algo.eps_low, algo.eps_high) == (EPS_LOW, EPS_HIGH)
    updater = PolicyUpdater(model, model.params, algo, 1e-3, 1.0, 1.0, tok.pad_id, packing_layout(cfg, 1))
    mask, zeros = jnp.array(M, jnp.float32), jnp.zeros(len(L))

    def objective(lp):
        return updater.objective(lp, None, mask, jnp.array(B), jnp.array(A), zeros, jnp.array(O), None, None)

    (loss, metrics), grad = jax.value_and_grad(objective, has_aux=True)(jnp.array(L))
    want_loss, want_grad = reference()
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-8)
    # what the case is built to show: 0 and 1 train, 2 and 3 (the policy already moved their way) do not
    assert (np.abs(want_grad[:2]) > 0).all() and not want_grad[2:].any()
    assert float(metrics["clip_fraction"]) == pytest.approx(6 / 14)
    assert "is_weight_mean" not in metrics  # the ratio against the sampler is the importance weight


def test_before_the_fix_stale_sequences_were_pushed_further_where_the_policy_had_already_gone():
    """The objective before issue 44: GSPO's ratio against the trainer's own weights o (1 within a step up to the
    first minibatch's update) with GRPO's clip of 0.2 and per-token truncated weights exp(o - b). Sequences 2 and 3,
    whose probability the policy already moved the way their advantage asks since the sampler drew them, are
    pushed further on every token: staleness never reaches the clip."""
    old, behaviour, mask = jnp.array(O), jnp.array(B), jnp.array(M, jnp.float32)
    grad = jax.grad(lambda lp: policy_loss(lp, old, jnp.array(A), mask, loss_algo="gspo-token", eps_low=0.2,
                                           eps_high=0.2, agg_mode="token-mean",
                                           is_weights=truncated_is_weights(old, behaviour, 2.0))[0])(jnp.array(L))
    grad = np.asarray(grad)
    assert (grad[2] < 0).all() and (grad[3, :2] > 0).all()
