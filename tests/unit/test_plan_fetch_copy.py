"""`grpo-stream plan` counts the copy of the weights a sampler fetches beside the one its engine decodes with, with
weights.background_fetch false as with true.

The engine serves on a thread of its own (sampler_service/engine_thread.py) and holds the installed version and its
decode layout until it takes a newer one at a scheduling point; the feeder's thread fetches (with background_fetch
false, synchronously, on its own thread, not the engine's): nothing gives the installed version up before the next
one arrives. The plan counted no fetch buffer without background fetching, so a device it passed (the 70B preset's
samplers) could run out of memory at the first publication: a whole copy of the weights more than it planned.

The sampler's parts are the real ones (engine thread, weights in use, weight sync), the fetcher the unit tests' own
(tests/unit/sampler_service/test_weight_sync.py), on one CPU device in the model's float32; the engine is held at a
scheduling point while the bytes on the device are counted, so no decode's outputs come and go meanwhile."""

import gc
import threading

import jax
import numpy as np

from grpo_stream.common.engine.base import FirstWeights, FixedRequests, Generation, Request
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.weights.snapshot import manifest_of
from grpo_stream.plan.programs import architecture, sampler_programs
from grpo_stream.sampler_service.engine_thread import EngineThread
from grpo_stream.sampler_service.weights_in_use import WeightsInUse
from tests.unit.sampler_service.test_weight_sync import Fetcher, sync_for

NO_EOS = -1
NEW_TOKENS = 64  # the rows decode past every measurement below (2 tokens a chunk)


def device_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


class Stream:
    """What the weights in use ask of a running RolloutStream: its episodes in flight (none: no drain waits)."""

    episodes_in_flight = 0

    def set_accepting(self, accepting: bool) -> None:
        pass


class HeldEngine:
    """The engine's scheduling points, stopped on request: `hold()` returns once the engine waits at one (no decode
    in flight), `release()` lets it go on."""

    def __init__(self, refresh):
        self.refresh, self.wanted = refresh, False
        self.waiting, self.go = threading.Event(), threading.Event()

    def __call__(self):
        if self.wanted:
            self.wanted = False
            self.waiting.set()
            self.go.wait(60)
            self.go.clear()
        return self.refresh()

    def hold(self) -> None:
        self.waiting.clear()
        self.wanted = True
        assert self.waiting.wait(60), "the engine reached no scheduling point"

    def release(self) -> None:
        self.go.set()


def test_the_plan_counts_the_version_a_sampler_fetches_without_background_fetching(tiny_parts):
    cfg, task, tok, model = tiny_parts
    cfg = cfg.model_copy(update={"weights": cfg.weights.model_copy(update={"background_fetch": False})})
    named = model.to_named_numpy()
    fetcher = Fetcher(named)
    weights = WeightsInUse(cfg, "sampler-0", threading.Event())
    weights.attach(sync_for(model, fetcher, background=False), None, None)
    weights.poll()  # version 0, before the stream
    weights.stream_started(Stream(), None)  # the stream runs: a fetched version is staged for the engine
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, NEW_TOKENS, 1.0, slots=4,
                              chunk_steps=2)
    prompts = [tok.encode(task.train_problem(i).prompt) for i in range(4)]
    out = Generation(*(np.zeros((4, NEW_TOKENS), d) for d in (np.int32, np.float32)), np.zeros(4, np.int32),
                     np.zeros(4, bool), np.zeros((4, NEW_TOKENS), np.int32))
    source = FixedRequests([Request(p, NEW_TOKENS, k, i) for i, (p, k) in
                            enumerate(zip(prompts, engine.request_keys(jax.random.key(0), 4)))], out)
    held = HeldEngine(weights.staged.refresh)
    params, version = weights.installed()
    thread = EngineThread(engine, FirstWeights(params), source, held, version, "engine")
    del params
    try:
        for _ in range(3):  # past the first chunks: the rows decode with version 0's re-laid weights
            held.hold()
            held.release()
        held.hold()
        serving = device_bytes()
        fetcher.manifest = manifest_of(1, {n: (a.shape, a.dtype) for n, a in named.items()}, False, "e1", 0.0, 0,
                                       "fake")
        weights.poll()  # the feeder's poll: the fetch runs here, whole, before it returns
        assert fetcher.fetches == 2 and weights.staged.holding()
        arrived = device_bytes()
        held.release()
        held.hold()  # the engine took version 1 at its scheduling point
        assert weights.version == 1 and not weights.staged.holding()
        installed = device_bytes()
    finally:
        held.release()
        thread.join(120)
    thread.check()
    version_bytes = sum(a.nbytes for a in named.values())
    # the version arrived beside the installed one and its layout, and the engine let the old go only once it took it
    assert arrived - serving >= version_bytes, (serving, arrived, version_bytes)
    assert abs(installed - serving) < version_bytes // 4, (serving, installed)
    plan = sampler_programs(cfg, architecture(cfg))["per_device_bytes"]
    assert plan["parameters"] == version_bytes
    assert plan["fetch_buffer"] >= arrived - serving - version_bytes // 20, (plan, arrived - serving)
    assert plan["total"] >= plan["parameters"] + plan["fetch_buffer"] + plan["decode_weights"] + plan["kv_cache"]
