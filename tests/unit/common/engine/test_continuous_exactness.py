"""What the continuous engine returns, against a plain forward pass of the same params (no slots, no cache): every
row's logprobs are the policy's log-softmax at the temperature, whatever prompt length (1 token to
max_prompt_tokens) and whatever ran in its slot before; greedy is a plain greedy decode; a stop token ends the
completion, is kept, counted and given its logprob; and the sampled tokens follow the temperature's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.engine.base import FixedRequests, Generation, Request
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.model.policy import causal_mask, policy_log_softmax, positions_from_mask

TEMPERATURE = 0.7
NO_EOS = -1
REFERENCE_LEN = 64  # the plain forward runs right-padded to this (causal: the padding changes no earlier logit)


@pytest.fixture(scope="module")
def plain_logprobs(tiny_parts):
    """The reference: [REFERENCE_LEN, V] policy log-softmax of `ids` at `temperature` from one plain forward pass."""
    _, _, tok, model = tiny_parts
    apply = jax.jit(lambda t, pos, mask: model.apply(model.params, t, pos, None, mask)[0])
    valid = jnp.ones((1, REFERENCE_LEN), bool)

    def logprobs(ids: list[int], temperature: float) -> np.ndarray:
        padded = np.asarray([list(ids) + [tok.pad_id] * (REFERENCE_LEN - len(ids))], np.int32)
        logits = apply(jnp.asarray(padded), positions_from_mask(valid), causal_mask(valid))
        return np.asarray(policy_log_softmax(logits, temperature, tok.pad_id))[0]
    return logprobs


def _engine(tiny_parts, eos, slots: int, chunk_steps: int, temperature: float = TEMPERATURE) -> ContinuousEngine:
    cfg, _, tok, model = tiny_parts
    return ContinuousEngine(model, tok.pad_id, eos, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens,
                            temperature=temperature, slots=slots, chunk_steps=chunk_steps)


def _alone(engine: ContinuousEngine, params, prompt: list[int], budget: int, key, greedy: bool = False) -> list[int]:
    """One row served alone: a serve starts from new slot groups, so nothing ran in its slot before."""
    width = engine.max_new_tokens
    out = Generation(np.zeros((1, width), np.int32), np.zeros((1, width), np.float32), np.zeros(1, np.int32),
                     np.zeros(1, np.bool_))
    engine.serve(params, FixedRequests([Request(list(prompt), budget, key, 0, greedy=greedy)], out))
    return out.tokens[0, :out.lengths[0]].tolist()


def test_logprobs_are_a_plain_forward_pass_and_rows_do_not_depend_on_their_slots_past(tiny_parts, plain_logprobs):
    """12 rows of prompt lengths 1 to max_prompt_tokens and budgets 1 to max_new_tokens through 3 slots (each slot
    reused about four times, rows ending in every order): each row's tokens are those it samples alone in fresh slots,
    and every logprob is the plain forward pass's."""
    cfg, _, tok, model = tiny_parts
    p, c = cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens
    rng = np.random.default_rng(0)
    lengths = [1, p, 2, 7, p, 13, 1, 20, 5, p - 1, 3, 17]
    prompts = [rng.integers(3, tok.vocab_size, n).tolist() for n in lengths]
    budgets = [c, c, 1, 9, 3, c, 2, 11, c, 5, 16, 7]
    engine = _engine(tiny_parts, NO_EOS, slots=3, chunk_steps=2)
    out = engine.generate(model.params, prompts, jax.random.key(3), max_new_tokens=budgets)
    assert out.lengths.tolist() == budgets
    keys = engine.request_keys(jax.random.key(3), len(prompts))
    fresh = _engine(tiny_parts, NO_EOS, slots=1, chunk_steps=2)
    for i, (prompt, n) in enumerate(zip(prompts, budgets)):
        completion = out.tokens[i, :n].tolist()
        assert completion == _alone(fresh, model.params, prompt, n, keys[i]), f"row {i} depends on its slot's past"
        reference = plain_logprobs(prompt + completion, TEMPERATURE)
        want = reference[np.arange(len(prompt) - 1, len(prompt) + n - 1), completion]
        np.testing.assert_allclose(out.logprobs[i, :n], want, atol=1e-4, err_msg=f"row {i}")


def test_greedy_is_a_plain_greedy_decode_and_a_stop_token_ends_the_completion(tiny_parts, plain_logprobs):
    """Stop tokens chosen so that greedy decoding meets one within a few tokens for most prompts: each row is the
    plain greedy decode up to and including its first stop token, counted in its length, with the stop token's
    logprob; rows that meet none run to their budget unfinished; nothing follows the end."""
    cfg, task, tok, model = tiny_parts
    c = cfg.generation.max_new_tokens
    prompts = [tok.encode(task.train_problem(i).prompt) for i in range(6)] + [[7], [9, 4]]
    plain = []
    for prompt in prompts:  # greedy by the plain forward pass, to the budget
        ids = list(prompt)
        for _ in range(c):
            ids.append(int(np.argmax(plain_logprobs(ids, 1.0)[len(ids) - 1])))
        plain.append(ids[len(prompt):])
    stops = sorted({completion[3] for completion in plain[:4]})  # the 4th token of the first four prompts' decodes
    out = _engine(tiny_parts, stops, slots=4, chunk_steps=3).generate(model.params, prompts, jax.random.key(0),
                                                                       greedy=True)
    assert out.finished[:4].all()
    for i, (prompt, completion) in enumerate(zip(prompts, plain)):
        ends = [j for j, t in enumerate(completion) if t in stops]
        n = ends[0] + 1 if ends else c
        assert out.lengths[i] == n and bool(out.finished[i]) == bool(ends), f"row {i}"
        assert out.tokens[i, :n].tolist() == completion[:n], f"row {i}"
        assert (out.tokens[i, n:] == tok.pad_id).all() and (out.logprobs[i, n:] == 0).all()
        reference = plain_logprobs(prompt + completion[:n], TEMPERATURE)  # logprobs at the policy's temperature
        want = reference[np.arange(len(prompt) - 1, len(prompt) + n - 1), completion[:n]]
        np.testing.assert_allclose(out.logprobs[i, :n], want, atol=1e-4, err_msg=f"row {i}")


def test_sampled_tokens_follow_the_temperatures_distribution(tiny_parts, plain_logprobs):
    """1024 rows of one prompt draw their first token at temperature 0.4 (the tiny random model's distribution is
    nearly flat; a low temperature makes a wrong one easy to tell): the mean of the drawn tokens' log-probability under
    the temperature's distribution p is -entropy(p) within 5 standard errors (a false failure about once in 1.7
    million runs), and sampling at temperature 1 instead would miss it by several times that margin (checked below
    on p itself)."""
    _, task, tok, model = tiny_parts
    rows, temperature = 1024, 0.4
    prompt = tok.encode(task.train_problem(0).prompt)
    logp = plain_logprobs(prompt, temperature)[len(prompt) - 1]
    prob = np.exp(logp)
    finite = np.where(prob > 0, logp, 0.0)
    mean = float((prob * finite).sum())
    margin = 5 * float(np.sqrt((prob * finite ** 2).sum() - mean ** 2)) / np.sqrt(rows)
    at_one = np.exp(plain_logprobs(prompt, 1.0)[len(prompt) - 1])
    assert mean - float((at_one * finite).sum()) > 3 * margin  # the check tells the two temperatures apart
    out = _engine(tiny_parts, NO_EOS, slots=64, chunk_steps=1, temperature=temperature).generate(
        model.params, [prompt] * rows, jax.random.key(np.random.randint(1 << 30)), max_new_tokens=[1] * rows)
    drawn = out.tokens[:, 0]
    assert tok.pad_id not in drawn.tolist()
    np.testing.assert_allclose(out.logprobs[:, 0], logp[drawn], atol=1e-4)
    assert abs(float(logp[drawn].mean()) - mean) < margin
