"""The sampler's engine thread holds only the weights its serve decodes with: once a newer version replaces the first,
nothing keeps the first alive (a whole extra copy of the weights on the device for the sampler's life)."""

import jax
import numpy as np

from grpo_stream.common.engine.base import FixedRequests, Generation, Request
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.sampler_service.engine_thread import EngineThread
from tests.version_swap import VersionSwap

NO_EOS = -1


def test_the_first_version_is_freed_once_a_newer_one_replaces_it(tiny_parts):
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 16, 1.0, slots=4,
                              chunk_steps=2)
    swap = VersionSwap(model.params)
    prompts = [tok.encode(task.train_problem(i).prompt) for i in range(2)]
    keys = engine.request_keys(jax.random.key(0), 2)
    out = Generation(np.zeros((2, 16), np.int32), np.zeros((2, 16), np.float32), np.zeros(2, np.int32),
                     np.zeros(2, bool), np.zeros((2, 16), np.int32))
    source = FixedRequests([Request(p, 16, k, i) for i, (p, k) in enumerate(zip(prompts, keys))], out)
    thread = EngineThread(engine, swap.first_weights(), source, swap.refresh, 0, "engine")
    thread.join(120)
    thread.check()
    assert swap.alive_after_update == [0]
    assert set(out.versions[:, -1].tolist()) == {1}  # the rows ended under the second version
