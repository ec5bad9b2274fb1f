"""A serve's first weights watched while a newer version replaces them: the sampler hands a serve its first version
in a FirstWeights so that nothing keeps it once the next is installed (a whole copy of the weights, on vLLM in host
memory, for the sampler's life). Used by the JAX engine's and the vLLM engine's checks alike."""

from __future__ import annotations

import gc
import weakref

import jax

from grpo_stream.common.engine.base import FirstWeights


class VersionSwap:
    """`first_weights()`: a copy of `params` (in a FirstWeights, kept nowhere else); `refresh`: the serve's refresh,
    handing over `second` at its second call and counting, two scheduling points later, the leaves of the first
    version still alive (`alive_after_update`: [0] when the serve let them go)."""

    def __init__(self, params):
        first = jax.tree.map(jax.numpy.copy, params)
        self._refs = [weakref.ref(leaf) for leaf in jax.tree_util.tree_leaves(first)]
        self._first = first
        self.second = jax.tree.map(lambda x: x * 1.0, params)
        self._calls, self.alive_after_update = 0, []

    def first_weights(self) -> FirstWeights:
        first, self._first = self._first, None
        return FirstWeights(first)

    def refresh(self):
        self._calls += 1
        if self._calls == 2:
            return self.second, 1
        if self._calls == 4:
            gc.collect()
            self.alive_after_update.append(sum(ref() is not None for ref in self._refs))
        return None
