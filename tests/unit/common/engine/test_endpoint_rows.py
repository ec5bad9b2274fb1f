"""The endpoint's sequences inside the real continuous engine (tiny model, CPU): a sequence whose caller went away
stops at the engine's next scheduling point and frees its slot, whether it was decoding or waiting for one; and a
flooded endpoint queue takes only its share of the slots, so the sampler's own batch is not held behind it."""

import jax
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.serving import endpoint_engine_rows
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.engine.side_requests import MergedSource, NoRequests, SideQueue, SideRequest
from tests.conftest import CONFIGS

NO_EOS = -1  # no token ends a completion: every sequence runs to its budget unless stopped
BUDGET, CHUNK, SLOTS = 32, 4, 8


@pytest.fixture(scope="module")
def engine(tiny_parts):
    cfg, _, tok, model = tiny_parts
    return ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, BUDGET, temperature=0.7,
                            slots=SLOTS, chunk_steps=CHUNK)


def _prompts(tiny_parts, n: int) -> list[list[int]]:
    _, task, tok, _ = tiny_parts
    return [tok.encode(task.train_problem(i).prompt) for i in range(n)]


def _outside(engine, prompt: list[int], n: int = 1) -> list[SideRequest]:
    return [SideRequest(ids=prompt, budget=BUDGET, key=key) for key in engine.request_keys(jax.random.key(7), n)]


def _withdraw_after_first_chunk(engine, queue: SideQueue, requests: list[SideRequest]):
    """A refresh hook (the engine calls it at every scheduling point): the caller leaves once a chunk was decoded."""
    start = engine.stats["decode_steps"]

    def scheduling_point():
        if engine.stats["decode_steps"] > start and not requests[0].cancelled:
            queue.withdraw(requests)
        return None
    return scheduling_point


def test_a_withdrawn_sequence_stops_decoding_and_frees_its_slot(tiny_parts, engine):
    _, _, _, model = tiny_parts
    queue = SideQueue(8)
    request, = _outside(engine, _prompts(tiny_parts, 1)[0])
    queue.submit([request])
    before = engine.stats["decode_steps"]
    engine.serve_alone(model.params, MergedSource(NoRequests(), queue, version=1, idle=True),
                       _withdraw_after_first_chunk(engine, queue, [request]), 1)
    assert request.cancelled and not request.done.is_set() and queue.in_engine == 0
    # stopped after its first chunk, not decoded to its budget for nobody
    assert engine.stats["decode_steps"] - before <= 2 * CHUNK < BUDGET
    assert not engine.table.main.live.any() and not engine.table.main.state.active.any()


def test_a_withdrawn_sequence_waiting_for_a_slot_is_never_admitted(tiny_parts, engine):
    _, _, _, model = tiny_parts
    prompts = _prompts(tiny_parts, SLOTS + 1)
    queue = SideQueue(8)
    request, = _outside(engine, prompts[-1])
    queue.submit([request])
    prefilled = engine.stats["prefill_rows"]
    engine.side = queue  # the sampler's own SLOTS rows take every slot: the endpoint's sequence waits
    try:
        out = engine.generate(model.params, prompts[:SLOTS], jax.random.key(0),
                              refresh=_withdraw_after_first_chunk(engine, queue, [request]), version=1)
    finally:
        engine.side = None
    assert (out.lengths == BUDGET).all()
    assert request.cancelled and not request.done.is_set() and queue.in_engine == 0
    assert engine.stats["prefill_rows"] - prefilled == SLOTS  # the withdrawn sequence was never prefilled


def test_a_flooded_endpoint_leaves_the_samplers_own_batch_its_slots(tiny_parts, engine):
    """One client keeps 64 sequences queued: the sampler's own batch shares the engine with at most
    sampler.openai.max_engine_share of its slots' worth of them, so it takes about two batches' decode steps (its
    own, then the endpoint's share), not the nine it took behind every queued sequence."""
    _, _, _, model = tiny_parts
    prompts = _prompts(tiny_parts, SLOTS)
    cfg = load_config(CONFIGS / "tiny_arith.yaml", [f"generation.decode_slots={SLOTS}",
                                                    f"sampler.rows_in_flight={SLOTS}"])
    share = endpoint_engine_rows(cfg)
    assert share == SLOTS // 2  # the default share, 0.5
    start = engine.stats["decode_steps"]
    engine.generate(model.params, prompts, jax.random.key(0))
    alone = engine.stats["decode_steps"] - start
    queue = SideQueue(cfg.sampler.openai.max_queued, share)
    queue.submit(_outside(engine, prompts[0], 64))
    inside, start = [], engine.stats["decode_steps"]
    engine.side = queue
    try:
        out = engine.generate(model.params, prompts, jax.random.key(0), version=1,
                              refresh=lambda: inside.append(queue.in_engine))
    finally:
        engine.side = None
    assert (out.lengths == BUDGET).all()
    assert max(inside) <= share and queue.served_in_sampler_batches == share
    assert engine.stats["decode_steps"] - start <= 2 * alone + 2 * CHUNK
