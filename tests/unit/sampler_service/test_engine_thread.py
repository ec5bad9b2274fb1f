"""The sampler's engine thread holds only the weights its serve decodes with: once a newer version replaces the first,
nothing keeps the first alive (a whole extra copy of the weights on the device for the sampler's life)."""

import gc
import weakref

import jax
import numpy as np

from grpo_stream.common.engine.base import FirstWeights, FixedRequests, Generation, Request
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.sampler_service.engine_thread import EngineThread

NO_EOS = -1


def test_the_first_version_is_freed_once_a_newer_one_replaces_it(tiny_parts):
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 16, 1.0, slots=4,
                              chunk_steps=2)
    first = jax.tree.map(jax.numpy.copy, model.params)
    refs = [weakref.ref(leaf) for leaf in jax.tree_util.tree_leaves(first)]
    second = jax.tree.map(lambda x: x * 1.0, model.params)
    calls, alive_after_update = [0], []

    def refresh():
        calls[0] += 1
        if calls[0] == 2:
            return second, 1
        if calls[0] == 4:  # two scheduling points after the update: the serve decodes with `second` only
            gc.collect()
            alive_after_update.append(sum(ref() is not None for ref in refs))
        return None

    prompts = [tok.encode(task.train_problem(i).prompt) for i in range(2)]
    keys = engine.request_keys(jax.random.key(0), 2)
    out = Generation(np.zeros((2, 16), np.int32), np.zeros((2, 16), np.float32), np.zeros(2, np.int32),
                     np.zeros(2, bool), np.zeros((2, 16), np.int32))
    source = FixedRequests([Request(p, 16, k, i) for i, (p, k) in enumerate(zip(prompts, keys))], out)
    thread = EngineThread(engine, FirstWeights(first), source, refresh, 0, "engine")
    del first
    thread.join(120)
    thread.check()
    assert alive_after_update == [0]
    assert set(out.versions[:, -1].tolist()) == {1}  # the rows ended under the second version
