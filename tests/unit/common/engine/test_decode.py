"""The sampler's decode forward must be the trainer's model (Tunix Qwen3) laid out differently, nothing more."""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.engine import decode
from grpo_stream.common.model.policy import causal_mask, policy_log_softmax, positions_from_mask


def _left_padded(rng: np.random.Generator, vocab: int, batch: int, length: int):
    tokens = rng.integers(3, vocab, size=(batch, length)).astype(np.int32)
    valid = np.ones((batch, length), bool)
    for i in range(batch):
        valid[i, :rng.integers(0, length // 2)] = False
    tokens[~valid] = 0
    return jnp.asarray(tokens), jnp.asarray(valid)


def test_prefill_logits_match_tunix_module(tiny_parts):
    _, _, tok, model = tiny_parts
    rng = np.random.default_rng()
    tokens, valid = _left_padded(rng, tok.vocab_size, 4, 24)
    positions, mask = positions_from_mask(valid), causal_mask(valid)
    want, _ = model.apply(model.params, tokens, positions, None, mask)
    w = decode.decode_weights(model, model.params)
    cache = decode.init_cache(model, 4, 24)
    got, _ = decode.forward(model, w, tokens, positions, cache, 0, mask)
    rows = np.asarray(valid)  # padded query rows are never read
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], rtol=1e-4, atol=1e-4)


def test_cached_one_token_steps_match_full_forward(tiny_parts):
    """Prefill half the sequence, then feed the rest one token at a time through the cache."""
    _, _, tok, model = tiny_parts
    rng = np.random.default_rng()
    batch, length, split = 3, 20, 12
    tokens, valid = _left_padded(rng, tok.vocab_size, batch, split)
    tail = jnp.asarray(rng.integers(3, tok.vocab_size, size=(batch, length - split)).astype(np.int32))
    full_tokens = jnp.concatenate([tokens, tail], axis=1)
    full_valid = jnp.concatenate([valid, jnp.ones((batch, length - split), bool)], axis=1)
    positions = positions_from_mask(full_valid)
    want, _ = model.apply(model.params, full_tokens, positions, None, causal_mask(full_valid))

    w = decode.decode_weights(model, model.params)
    cache = decode.init_cache(model, batch, length)
    prefill_mask = jnp.pad(causal_mask(valid), ((0, 0), (0, 0), (0, length - split)))
    _, cache = decode.forward(model, w, tokens, positions[:, :split], cache, 0, prefill_mask)
    step_logits = []
    for t in range(split, length):
        key_valid = (full_valid & (jnp.arange(length) <= t)[None])[:, None, :]
        logits, cache = decode.forward(model, w, full_tokens[:, t:t + 1], positions[:, t:t + 1], cache, t, key_valid)
        step_logits.append(logits[:, 0])
    got = np.stack([np.asarray(x) for x in step_logits], axis=1)
    np.testing.assert_allclose(got, np.asarray(want)[:, split:], rtol=1e-4, atol=1e-4)


def test_inverse_cdf_matches_distribution_and_skips_zero_mass():
    logits = jnp.asarray([[2.0, 0.0, 1.0, -1.0, 0.5, 3.0]] * 2)
    logp = policy_log_softmax(logits, 1.0, pad_id=1)  # token 1 masked out, as the pad is
    draws = 40_000
    keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), draws // 2)
    samples = np.asarray(jax.vmap(lambda k: decode.sample_inverse_cdf(k, logp))(keys)).ravel()
    assert 1 not in samples
    counts = np.bincount(samples, minlength=6) / samples.size
    want = np.exp(np.asarray(logp[0]))
    # 5 sigma of a binomial proportion at 40k draws is < 0.013
    np.testing.assert_allclose(counts, want, atol=0.013)


def test_inverse_cdf_never_draws_masked_token_at_boundaries():
    """Uniforms at the edges of (0, 1] and on CDF steps still land on tokens with mass."""
    logp = jnp.log(jnp.asarray([[0.0, 0.5, 0.0, 0.5, 0.0]]))
    for u, want in ((2 ** -24, 1), (0.5, 1), (0.5 + 2 ** -24, 3), (1.0, 3)):
        assert int(decode.inverse_cdf_index(jnp.asarray([u], jnp.float32), logp)[0]) == want
