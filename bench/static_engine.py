"""The static JAX engine: grpo-stream's first sampling engine, kept only as `bench sampler`'s baseline.

It decodes a whole batch in one `lax.scan` of max_new_tokens steps: every row
runs to the end even after it stopped, the longest completion holds the batch,
each of a group's rows prefills the same prompt, and every step attends over
the whole cache. The continuous engine (`grpo_stream.common.engine.continuous`) replaces it.

Prompts are left-padded to `max_prompt_tokens`, completions occupy the next
`max_new_tokens` cache slots; one compiled program per (batch, lengths,
greedy). The forward pass is `grpo_stream.common.engine.decode` (the policy re-laid for
decoding); tokens are drawn by inverse-CDF sampling from the same
distribution the trainer scores (`policy_log_softmax`). The trainer lays sequences out the same way, so positions and
masks match and behaviour logprobs equal the trainer's recomputation to
float rounding.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.engine import decode
from grpo_stream.common.engine.base import Generation, check_request
from grpo_stream.common.model.policy import PolicyModel, causal_mask, policy_log_softmax, positions_from_mask


class StaticEngine:
    """Generates completions for batches of token-id prompts with one model's weights."""

    fixed_shape = True  # one compiled program per batch shape: callers pad batches to one size

    def __init__(self, model: PolicyModel, pad_id: int, eos_id: int | list[int], max_prompt_tokens: int,
                 max_new_tokens: int, temperature: float):
        """`eos_id`: the stop token, or all of them (Llama 3 Instruct stops on several)."""
        self.model, self.pad_id = model, pad_id
        self.eos_ids = tuple(eos_id) if isinstance(eos_id, (list, tuple)) else (eos_id,)
        self.max_prompt_tokens, self.max_new_tokens, self.temperature = max_prompt_tokens, max_new_tokens, temperature
        decode.check_sequence_fits(model, max_prompt_tokens + max_new_tokens)
        self._generate = jax.jit(self._generate_impl, static_argnames=("greedy",))
        # re-laid weights are made once per parameter object (weight version), not per batch
        self._relayout = jax.jit(functools.partial(decode.decode_weights, model))
        self._relaid: tuple[Any, Any] = (None, None)

    def left_pad(self, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        p = self.max_prompt_tokens
        tokens = np.full((len(prompts), p), self.pad_id, np.int32)
        mask = np.zeros((len(prompts), p), np.bool_)
        for i, ids in enumerate(prompts):
            tokens[i, p - len(ids):] = ids
            mask[i, p - len(ids):] = True
        return tokens, mask

    def generate(self, params: Any, prompts: list[list[int]], rng: jax.Array, greedy: bool = False,
                 max_new_tokens: list[int] | None = None) -> Generation:
        """`max_new_tokens`: per-row budgets; a row stops there, but the batch still runs max_new_tokens steps."""
        budgets = check_request(prompts, max_new_tokens, self.max_prompt_tokens, self.max_new_tokens)
        tokens, mask = self.left_pad(prompts)
        if self._relaid[0] is not params:
            self._relaid = (None, None)  # free the previous version's copy first
            self._relaid = (params, self._relayout(params))
        out_tokens, out_logprobs, lengths, finished = jax.device_get(
            self._generate(self._relaid[1], jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(budgets), rng,
                           greedy=greedy))
        return Generation(np.asarray(out_tokens), np.asarray(out_logprobs), np.asarray(lengths), np.asarray(finished))

    def _generate_impl(self, weights, prompt_tokens, prompt_mask, budgets, rng, greedy: bool):
        batch, p = prompt_tokens.shape
        c = self.max_new_tokens
        total = p + c
        cache = decode.init_cache(self.model, batch, total)
        key_valid = jnp.concatenate([prompt_mask, jnp.zeros((batch, c), jnp.bool_)], axis=1)
        prefill_mask = jnp.pad(causal_mask(prompt_mask), ((0, 0), (0, 0), (0, c)))
        logits, cache = decode.forward(self.model, weights, prompt_tokens, positions_from_mask(prompt_mask), cache, 0,
                                       prefill_mask)
        last_logits = logits[:, -1]
        prompt_len = prompt_mask.sum(axis=1).astype(jnp.int32)
        slots = jnp.arange(total)

        def step(carry, t):
            cache, last_logits, key_valid, done, rng = carry
            rng, sub = jax.random.split(rng)
            logp = policy_log_softmax(last_logits, self.temperature, self.pad_id)
            if greedy:
                tok = jnp.argmax(logp, axis=-1).astype(jnp.int32)
            else:
                tok = decode.sample_inverse_cdf(sub, logp)
            tok_logp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
            out_tok = jnp.where(done, self.pad_id, tok)
            out_logp = jnp.where(done, 0.0, tok_logp)
            done_next = done | jnp.isin(tok, jnp.asarray(self.eos_ids, jnp.int32)) | (t + 1 >= budgets)
            key_valid = key_valid.at[:, p + t].set(True)
            attn = (key_valid & (slots <= p + t)[None, :])[:, None, :]
            pos = (prompt_len + t)[:, None]
            logits, cache = decode.forward(self.model, weights, out_tok[:, None], pos, cache, p + t, attn)
            return (cache, logits[:, -1], key_valid, done_next, rng), (out_tok, out_logp, done)

        done0 = jnp.zeros((batch,), jnp.bool_)
        (_, _, _, done, _), (toks, logps, was_done) = jax.lax.scan(
            step, (cache, last_logits, key_valid, done0, rng), jnp.arange(c))
        toks, logps, was_done = toks.T, logps.T, was_done.T
        lengths = (~was_done).sum(axis=1).astype(jnp.int32)
        return toks, logps, lengths, done

