"""An environment's step has a bounded time: a user-written environment's `Episode.step` that hung held its worker,
its episode and its group for ever, and `environment.workers` such steps held every worker (no episode of the
sampler went on). Now the step is given up after EpisodeSettings.step_seconds (environment.turn_tool_seconds plus a
margin), its episode ends with an error naming the setting, and the worker answers other episodes."""

import threading

import jax
import pytest

from grpo_stream.common.environments.base import Observation, Turn
from grpo_stream.common.environments.render import PlainRenderer
from grpo_stream.common.episodes.result import GroupWork
from grpo_stream.common.episodes.stream import RolloutStream
from grpo_stream.common.episodes.tool_turns import EpisodeSettings, ToolTurns
from grpo_stream.common.runtime.given_up import TooManyGivenUp
from tests.support import wait_for


class HangsOnRowZero:
    """Row 0's episode hangs in its step until `released`; the others end at their first step."""

    def __init__(self):
        self.released, self.started = threading.Event(), 0

    def start(self, problem):
        env, row = self, self.started
        self.started += 1

        class Episode:
            def step(self, text):
                if row == 0:
                    env.released.wait()
                    return Turn(Observation("late"), reward=5.0)  # dropped: its episode has ended
                return Turn(None, reward=1.0)
        return Episode()


def test_a_hung_step_ends_its_episode_and_frees_its_worker(tiny_parts):
    cfg, task, tok, _ = tiny_parts
    problem = task.train_problem(0)
    env, ended = HangsOnRowZero(), []
    stream = RolloutStream(lambda key, rows: list(range(rows)), ended.append)
    settings = EpisodeSettings(max_turns=4, turn_max_new_tokens=8, episode_tokens=40, step_seconds=0.2)
    kind = ToolTurns(env, PlainRenderer(tok), settings, tok, workers=1)  # one worker: a held one holds all
    sampled = tok.encode(" 42") + [tok.eos_id]
    try:
        stream.start(GroupWork(problem, tok.encode(problem.prompt), 2, None, "g", 0, jax.random.key(0)), kind)
        for request in sorted(stream.take(), key=lambda r: r.tag.row):  # row 0 first: it takes the one worker
            stream.finish(request, sampled, [-0.5] * len(sampled), None, True)
        # the hang guard of the test itself, far past the step's 0.2 s: unbounded, the group never ends
        wait_for(lambda: ended, 30, "the group whose first episode's step hangs to end")
    finally:
        env.released.set()
        kind.close()
    hung, answered = ended[0].results
    assert hung.error.startswith("StepTimedOut: the environment's step did not answer within 0.2 s") and \
        "environment.turn_tool_seconds" in hung.error, hung.error
    assert not hung.finished and hung.turn_rewards == [] and hung.tokens == sampled
    assert answered.error is None and answered.finished and answered.turn_rewards == [1.0]
    assert stream.episodes_in_flight == 0


class RaisesInStep:
    """Every episode's step raises `error`."""

    def __init__(self, error: BaseException):
        self.error = error

    def start(self, problem):
        error = self.error

        class Episode:
            def step(self, text):
                raise error
        return Episode()


def one_episode(tiny_parts, env, then=lambda stream, kind, work: None):
    """The result of a group of one episode of `env` whose model turn ends at once; `then(stream, kind, work)` runs
    after the group ended, before the kind closes (`work(i)`: a group to start)."""
    cfg, task, tok, _ = tiny_parts
    problem = task.train_problem(0)
    ended = []
    stream = RolloutStream(lambda key, rows: list(range(rows)), ended.append)
    settings = EpisodeSettings(max_turns=4, turn_max_new_tokens=8, episode_tokens=40, step_seconds=30.0)
    kind = ToolTurns(env, PlainRenderer(tok), settings, tok, workers=1)
    sampled = tok.encode(" 42") + [tok.eos_id]
    work = lambda i: GroupWork(problem, tok.encode(problem.prompt), 1, None, f"g{i}", i, jax.random.key(i))  # noqa
    try:
        stream.start(work(0), kind)
        [request] = stream.take()
        stream.finish(request, sampled, [-0.5] * len(sampled), None, True)
        wait_for(lambda: ended, 30, "the group of one episode to end")
        then(stream, kind, work)
    finally:
        kind.close()
    [result] = ended[0].results
    return result


def test_a_step_that_raises_within_its_bound_ends_its_episode_with_its_error(tiny_parts):
    """The bounded step hands what the step raised back to the worker: the episode ends with that error."""
    result = one_episode(tiny_parts, RaisesInStep(KeyError("no such table")))
    assert result.error == "KeyError: 'no such table'" and not result.finished


def test_a_hung_start_fails_its_group_and_frees_the_feeder(tiny_parts):
    """An environment's `start` runs on the sampler's feeder (the thread that feeds the engine): one that hung froze
    the whole sampler. It is bounded as a step is, and the group fails naming why."""
    cfg, task, tok, _ = tiny_parts
    released = threading.Event()

    class HangsAtStart:
        def start(self, problem):
            released.wait()

    problem = task.train_problem(0)
    ended, returned = [], []
    stream = RolloutStream(lambda key, rows: list(range(rows)), ended.append)
    settings = EpisodeSettings(max_turns=4, turn_max_new_tokens=8, episode_tokens=40, step_seconds=0.2)
    kind = ToolTurns(HangsAtStart(), PlainRenderer(tok), settings, tok, workers=1)
    work = GroupWork(problem, tok.encode(problem.prompt), 2, None, "g", 0, jax.random.key(0))
    feeder = threading.Thread(target=lambda: returned.append(stream.start(work, kind)), daemon=True)
    try:
        feeder.start()
        wait_for(lambda: returned, 30, "the feeder to come back from a group whose environment's start hangs")
    finally:
        released.set()
        kind.close()
    assert len(ended) == 1 and all(r.failed is not None and "start did not answer within 0.2 s" in r.failed
                                   for r in ended[0].results), ended


def test_too_many_hung_calls_stop_the_sampler_at_its_next_group(tiny_parts):
    """Past common/runtime/given_up.py's cap every step fails its episode, and the sampler ran on, beating, making
    failed groups only: the next group's start now raises it on the feeder's thread, which stops the sampler (`up`
    restarts it, and the hung threads go with the old process)."""
    def next_group(stream, kind, work):
        with pytest.raises(TooManyGivenUp, match="64 calls given up on"):
            stream.start(work(1), kind)

    result = one_episode(tiny_parts, RaisesInStep(TooManyGivenUp("64 calls given up on are still running")),
                         next_group)
    assert result.error.startswith("TooManyGivenUp: 64 calls") and not result.finished
