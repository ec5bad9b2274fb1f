"""The rollout stream on the continuous engine (issue 55): groups started while others decode sample exactly what
`engine.generate` samples for their keys; a group is handed on as soon as its last episode ends, whatever the other
groups in flight do; a group's long tail holds room for its last row only; greedy and sampled rows share one serve; a
cancelled stream ends the serve at once; a serve that lasts keeps rows for what is in flight only."""

import threading
import types

import jax
import numpy as np
import pytest

from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.episodes.finite import run_groups
from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.episodes.single_turn import SingleTurn
from grpo_stream.common.episodes.stream import RolloutStream
from grpo_stream.common.tasks.rewards import DEFAULT_WEIGHTS, RewardSet
from tests.support import wait_for

P, C, G = 24, 16, 4


@pytest.fixture(scope="module")
def engine(tiny_parts):
    cfg, task, tok, model = tiny_parts
    return ContinuousEngine(model, tok.pad_id, tok.eos_id, P, C, temperature=1.0, slots=8, chunk_steps=4)


def works(tiny_parts, n: int, greedy: bool = False, budgets=None) -> list[GroupWork]:
    cfg, task, tok, model = tiny_parts
    return [GroupWork(task.train_problem(i), tok.encode(task.train_problem(i).prompt), G, RewardSet(DEFAULT_WEIGHTS),
                      f"g{i}", i, jax.random.fold_in(jax.random.key(11), i), greedy=greedy,
                      budgets=None if budgets is None else budgets[i]) for i in range(n)]


def test_a_group_samples_what_generate_samples_for_its_key_whatever_decodes_beside_it(tiny_parts, engine):
    _, _, _, model = tiny_parts
    groups = works(tiny_parts, 6)  # 24 rows through 8 slots, at most 12 in flight: groups overlap and interleave
    made = run_groups(engine, model.params, groups, SingleTurn(C), max_rows=12)
    for work, results in zip(groups, made):
        alone = engine.generate(model.params, [work.prompt_ids] * G, work.key)
        for row, result in enumerate(results):
            n = int(alone.lengths[row])
            assert result.tokens == alone.tokens[row, :n].tolist(), (work.group_id, row)
            assert np.allclose(result.logprobs, alone.logprobs[row, :n], atol=1e-5)
            assert result.finished == bool(alone.finished[row])


def test_greedy_and_sampled_groups_share_one_serve(tiny_parts, engine):
    _, _, _, model = tiny_parts
    sampled, greedy = works(tiny_parts, 2), works(tiny_parts, 2, greedy=True)
    made = run_groups(engine, model.params, [sampled[0], greedy[0], sampled[1], greedy[1]], SingleTurn(C))
    argmax = engine.generate(model.params, [greedy[0].prompt_ids], greedy[0].key, greedy=True)
    assert all(r.tokens == argmax.tokens[0, :argmax.lengths[0]].tolist() for r in made[1])  # every greedy row alike
    assert len({tuple(r.tokens) for r in made[0]}) > 1  # sampled rows differ


class Paced:
    """The stream as the engine sees it, each chunk boundary waiting until the test has started every group that fits:
    the schedule a sampler's feeder keeps, whatever a loaded machine does to the test's thread."""

    def __init__(self, stream: RolloutStream, caught_up):
        self.stream, self.caught_up = stream, caught_up

    def take(self):
        wait_for(self.caught_up, 30, "the test to start the groups that fit")
        return self.stream.take()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def test_groups_are_handed_on_as_their_last_episode_ends_and_a_long_tail_holds_one_row(tiny_parts):
    """Group 0 has one long row (16 tokens, the others 1; no stop token can end a row early): the stream hands on
    the groups started after it before it, and while its long row decodes it holds room for that row only, so new
    groups keep starting beside it."""
    _, _, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, -1, P, C, temperature=1.0, slots=8, chunk_steps=1)
    budgets = [[16, 1, 1, 1]] + [[1, 1, 1, 1]] * 5
    order, room_seen = [], []
    stream = RolloutStream(engine.request_keys, lambda run: order.append(run.work.group_id))
    pending = works(tiny_parts, 6, budgets=budgets)

    def fits() -> bool:
        return bool(pending) and stream.episodes_in_flight + G <= 8

    serve = threading.Thread(target=engine.serve, args=(model.params, Paced(stream, lambda: not fits())))
    serve.start()
    kind = SingleTurn(C)
    while pending or stream.episodes_in_flight:
        while fits():
            stream.start(pending[0], kind)  # in flight before it leaves `pending`, so `fits` always sees it once
            pending.pop(0)
            room_seen.append(stream.episodes_in_flight)
        stream.wait_change(0.05)
    stream.close()
    serve.join(30)
    assert not serve.is_alive() and sorted(order) == [f"g{i}" for i in range(6)]
    assert order[-1] == "g0"  # the long group ended after every group started after it
    assert 5 in room_seen  # a later group started beside g0 holding room for its one long row only
    assert stream.groups_started == stream.groups_done == 6 and stream.episodes_in_flight == 0


def test_a_cancelled_stream_ends_the_serve_without_its_groups(tiny_parts, engine):
    _, _, _, model = tiny_parts
    done = []
    stream = RolloutStream(engine.request_keys, done.append)
    serve = threading.Thread(target=engine.serve, args=(model.params, stream))
    serve.start()
    for work in works(tiny_parts, 2, budgets=[[C] * G] * 2):
        stream.start(work, SingleTurn(C))
    stream.cancel()
    serve.join(30)
    assert not serve.is_alive() and not stream.open() and stream.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        stream.start(works(tiny_parts, 1)[0], SingleTurn(C))


def test_a_long_serve_keeps_rows_for_what_is_in_flight_only(tiny_parts, engine):
    _, _, _, model = tiny_parts
    one = works(tiny_parts, 1)[0]
    many = [GroupWork(one.problem, one.prompt_ids, G, one.rewards, f"x{i}", i, jax.random.fold_in(one.key, i))
            for i in range(40)]
    run_groups(engine, model.params, many, SingleTurn(C), max_rows=8)
    assert len(engine.rows.requests) <= 16  # 160 requests taken, rows recycled: at most what was in flight at once


def test_a_group_stays_in_flight_until_on_group_has_it():
    """The last episode's thread (an environment's worker) removed its group from the stream before calling
    on_group: in that gap the feeder counted the group neither in flight nor in the sink (its Admit one short: the
    ingest over-granted), and a closed stream read as ended, so run_groups' serve could end without the group."""
    handing_over, release = threading.Event(), threading.Event()
    handed = []

    def on_group(run):
        handing_over.set()
        release.wait(30)
        handed.append(run)

    stream = RolloutStream(lambda rng, n: [None] * n, on_group)
    work = GroupWork(None, [1], 1, None, "g0", 0, None)
    run = stream.start(work, types.SimpleNamespace(start=lambda run: None))
    stream.close()
    ender = threading.Thread(target=run.episode_done, args=(0, EpisodeResult(tokens=[1], finished=True)))
    ender.start()
    try:
        assert handing_over.wait(30)
        assert stream.in_flight() == [run] and stream.open()  # counted until the sink has it
    finally:
        release.set()
        ender.join(30)
    assert handed == [run] and stream.in_flight() == [] and not stream.open() and stream.groups_done == 1


def test_an_on_group_that_raises_still_ends_its_group():
    """The hand-over's error reaches the thread that ended the group; the group no longer holds the stream open."""
    stream = RolloutStream(lambda rng, n: [None] * n, lambda run: 1 / 0)
    run = stream.start(GroupWork(None, [1], 1, None, "g0", 0, None), types.SimpleNamespace(start=lambda run: None))
    stream.close()
    with pytest.raises(ZeroDivisionError):
        run.episode_done(0, EpisodeResult(tokens=[1], finished=True))
    assert stream.in_flight() == [] and not stream.open()


def test_a_turn_that_ends_wakes_a_feeder_waiting_for_room():
    """A multi-turn episode's turn ending (its row off to a tool) frees an engine slot: the feeder waiting for room
    is woken then, not at the end of its wait (the engine ran a slot short until the feeder's next look)."""
    stream = RolloutStream(lambda rng, n: [None] * n, lambda run: None)
    turns = []
    stream.submit(types.SimpleNamespace(tag=types.SimpleNamespace(turn_done=lambda *args: turns.append(args))))
    (request,) = stream.take()
    assert stream.room(rows_in_flight=8, slots=1) == 0
    waiting, woken = threading.Event(), threading.Event()

    def feeder():
        with stream._cond:  # wait_change's own wait, entered before the turn ends so no wake is missed
            waiting.set()
            stream._cond.wait(600)
        woken.set()

    thread = threading.Thread(target=feeder, daemon=True)
    thread.start()
    assert waiting.wait(30)
    with stream._cond:  # the feeder is inside its wait once this lock is free again
        pass
    stream.finish(request, [1], [0.0], None, finished=False)
    assert woken.wait(30) and len(turns) == 1 and stream.room(rows_in_flight=8, slots=1) == 1
