"""The reference for in-flight weight updates, shared by the JAX engine's tests and the vLLM engine's (which run in
the vLLM environment, without pytest): a completion's logprobs recomputed one token at a time, each token under the
weights of the version its engine recorded for it."""

import jax
import numpy as np


def scaled_versions(params, count: int, step: float):
    """`count` clearly different versions: version k is every weight times (1 + step * k), version 0 `params`."""
    return [params] + [jax.tree_util.tree_map(lambda x, k=k: x * (1.0 + step * k), params) for k in range(1, count)]


def every_other_call(versions):
    """An engine's `refresh`: the next version at every second call (while there is one), None otherwise."""
    calls = {"n": 0}

    def refresh():
        calls["n"] += 1
        v = calls["n"] // 2
        return (versions[v], v) if calls["n"] % 2 == 0 and v < len(versions) else None

    return refresh


class MixedVersionReference:
    """One row at a time, one token at a time, no slots or chunks: token j's logprob under the weights of the
    version it records, which also wrote token j-1's key and value (the prompt's: the version of token 0), as the
    engines document. Built once for a set of versions and a cache length, so its decode step compiles once."""

    def __init__(self, model, versions_params, cache_len: int):
        from grpo_stream.common.engine import decode

        self.model, self.cache_len, self.decode = model, cache_len, decode
        self.weights = [decode.decode_weights(model, params) for params in versions_params]
        self.step = jax.jit(lambda w, t, at, cache, valid: decode.forward(model, w, t, at[None, None], cache, at,
                                                                          valid))

    def __call__(self, prompt, tokens, token_versions, temperature, pad_id) -> np.ndarray:
        from grpo_stream.common.model.policy import policy_log_softmax

        p, n = len(prompt), self.cache_len
        cache = self.decode.init_cache(self.model, 1, n)
        mask = np.pad(np.tril(np.ones((p, p), bool))[None], ((0, 0), (0, 0), (0, n - p)))
        logits, cache = self.decode.forward(self.model, self.weights[token_versions[0]], np.asarray([prompt]),
                                            np.arange(p)[None], cache, 0, mask)
        out = []
        for j, tok in enumerate(tokens):
            if j:
                at = p + j - 1
                logits, cache = self.step(self.weights[token_versions[j]], np.asarray([[tokens[j - 1]]]),
                                          np.int32(at), cache, (np.arange(n) <= at)[None, None])
            out.append(float(policy_log_softmax(logits[:, -1], temperature, pad_id)[0, tok]))
        return np.asarray(out)


def mixed_version_logprobs(model, versions_params, prompt, tokens, token_versions, temperature, pad_id):
    """MixedVersionReference for one row, its cache as long as the row."""
    return MixedVersionReference(model, versions_params, len(prompt) + len(tokens))(prompt, tokens, token_versions,
                                                                                    temperature, pad_id)
