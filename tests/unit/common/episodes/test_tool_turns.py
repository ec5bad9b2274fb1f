"""Multi-turn episodes (the environment rollout kind) on the continuous engine's stream: token in, token out,
observations carry no logprob, and the trainer's recomputation at lag 0 equals the behaviour logprobs on every model
token."""

import threading
import time

import jax
import numpy as np
import pytest

from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.environments.base import Observation, Turn
from grpo_stream.common.environments.render import PlainRenderer
from grpo_stream.common.episodes.finite import run_episodes
from grpo_stream.common.episodes.tool_turns import EpisodeSettings, ToolTurns
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.trainer_service.learning.batching import layout

P, C = 24, 40


class Scripted:
    """Answers every turn with `= <turn number>` until `turns` turns, on a pool thread after `delay` seconds. Given
    the `engine`, it records what overlapped its steps: the most steps running at once, and whether the engine took
    decode steps while one of them ran."""

    def __init__(self, turns, delay=0.0, engine=None):
        self.turns, self.delay, self.seen, self.threads = turns, delay, [], set()
        self.engine, self.running, self.most_at_once, self.decoded_meanwhile = engine, 0, 0, 0
        self._lock = threading.Lock()

    def _decode_steps(self) -> int:
        return self.engine.stats.get("decode_steps", 0) if self.engine is not None else 0

    def start(self, problem):
        env = self

        class Episode:
            count = 0

            def step(self, text):
                env.threads.add(threading.current_thread().name)
                env.seen.append(text)
                with env._lock:
                    env.running += 1
                    env.most_at_once = max(env.most_at_once, env.running)
                before = env._decode_steps()
                time.sleep(env.delay)
                with env._lock:
                    env.running -= 1
                    env.decoded_meanwhile += env._decode_steps() > before
                self.count += 1
                return Turn(Observation(f"= {self.count}") if self.count < env.turns else None, reward=0.5)
        return Episode()


@pytest.fixture(scope="module")
def engine(tiny_parts):
    cfg, task, tok, model = tiny_parts
    return ContinuousEngine(model, tok.pad_id, tok.eos_id, P, C, temperature=1.0, slots=8, chunk_steps=4)


@pytest.fixture(scope="module")
def few_slots(tiny_parts):
    """Fewer slots than episodes and short chunks (frequent weight updates): shared by the tests that need either,
    so its programs compile once for the file, not once a test."""
    cfg, task, tok, model = tiny_parts
    return ContinuousEngine(model, tok.pad_id, tok.eos_id, P, C, temperature=1.0, slots=4, chunk_steps=2)


def _run(tiny_parts, engine, n, env, settings, rng=0, refresh=None, workers=4):
    cfg, task, tok, model = tiny_parts
    problems = [task.train_problem(i) for i in range(n)]
    prompts = [tok.encode(p.prompt) for p in problems]
    kind = ToolTurns(env, PlainRenderer(tok), settings, tok, workers)
    started = time.monotonic()
    try:
        results = run_episodes(engine, model.params, problems, prompts, kind, jax.random.key(rng), refresh=refresh)
    finally:
        kind.close()
    return prompts, results, {"turns": sum(r.turns for r in results), "seconds": time.monotonic() - started,
                              "environment_seconds": kind.environment_seconds}


@pytest.mark.parametrize("hold_kv", [False, True], ids=["reprefill", "hold"])
def test_model_tokens_are_exact_and_observations_carry_no_loss(tiny_parts, engine, hold_kv):
    """Whether the next turn re-prefills the conversation or resumes the held cache fed with the observation."""
    cfg, task, tok, model = tiny_parts
    settings = EpisodeSettings(max_turns=3, turn_max_new_tokens=8, episode_tokens=C, hold_kv=hold_kv)
    before = dict(engine.stats)
    prompts, results, figures = _run(tiny_parts, engine, 12, Scripted(turns=3), settings)
    resumed = engine.stats["resumed_turns"] - before.get("resumed_turns", 0)
    given_up = engine.stats["held_given_up"] - before.get("held_given_up", 0)
    # every later turn resumed its held cache, or was prefilled because its slot went to a waiting row (8 slots)
    assert (resumed > 0 and resumed + given_up == figures["turns"] - 12) if hold_kv else resumed == given_up == 0
    assert figures["turns"] > 12  # episodes went past their first turn
    rows = [layout(np.array(p), np.array(r.tokens), P, C, tok.pad_id) for p, r in zip(prompts, results)]
    tokens, valid = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    recomputed = np.asarray(sequence_logprobs(model, model.params, tokens, valid, 1.0, tok.pad_id))[:, P - 1:]
    diffs = []
    for i, r in enumerate(results):
        mask = np.array(r.model_mask)
        assert len(r.tokens) == len(r.logprobs) == len(mask) <= C and mask[0]
        assert (np.array(r.logprobs)[~mask] == 0).all()
        diffs.append(np.abs(recomputed[i, :len(mask)][mask] - np.array(r.logprobs)[mask]))
        # each observation is the renderer's ids, whole, after a model turn (a cut turn's stop token first)
        obs_runs = np.split(np.array(r.tokens)[~mask], np.flatnonzero(np.diff(np.flatnonzero(~mask)) > 1) + 1)
        for k, run in enumerate(o for o in obs_runs if len(o)):
            expected = tok.encode(f" = {k + 1}")
            assert run.tolist() in (expected, [tok.eos_id] + expected)
        # every turn answered (the last, at max_turns, too: its turn reward counts), but one cut by the budget
        cut = len(r.tokens) >= C and not r.turn_closed[-1]
        assert r.turns <= 3 and len(r.turn_rewards) == r.turns - cut
        if r.turns == 3 and len(r.tokens) < C:  # ended by max_turns: finished only if its last turn was not cut
            assert r.finished == r.turn_closed[-1]
    assert {r.turn_closed[-1] for r in results if r.turns == 3 and len(r.tokens) < C} == {True, False}
    diffs = np.concatenate(diffs)
    assert diffs.mean() <= 1e-5 and diffs.max() <= 1e-4


def test_an_episode_max_turns_cuts_while_the_environment_would_go_on_is_truncated(tiny_parts, engine):
    """Its last turn is a tool call, not an answer: it was counted finished and scored as one (code printing
    `#### 75` read as the answer), and the environment never gave that turn its reward."""
    settings = EpisodeSettings(max_turns=3, turn_max_new_tokens=6, episode_tokens=C)
    _, results, _ = _run(tiny_parts, engine, 8, Scripted(turns=5), settings, rng=2)
    at_max = [r for r in results if r.turns == 3 and len(r.tokens) < C]
    assert at_max and not any(r.finished for r in at_max)
    assert all(r.turn_rewards == [0.5] * 3 for r in at_max)


def test_environment_steps_run_off_the_decode_thread_while_other_episodes_decode(tiny_parts, engine):
    """With a 0.2 s tool, 16 episodes of 3 turns: the steps run on the environment's workers, several at once, and
    the engine decodes other episodes while they wait (observed, not timed: a step sees the engine's decode steps
    move during its wait)."""
    settings = EpisodeSettings(max_turns=3, turn_max_new_tokens=6, episode_tokens=C)
    env = Scripted(turns=3, delay=0.2, engine=engine)
    _, results, figures = _run(tiny_parts, engine, 16, env, settings, rng=1)
    assert all(name.startswith("environment") for name in env.threads)
    assert figures["environment_seconds"] >= 0.2 * (figures["turns"] - 16)
    assert env.most_at_once >= 2, env.most_at_once
    assert env.decoded_meanwhile > 0


def test_held_caches_are_given_up_when_rows_need_their_slots(tiny_parts, few_slots):
    """4 slots for 9 episodes: held slots are given up for waiting rows, and those episodes' next turns are
    prefilled; the tokens stay exact either way."""
    cfg, task, tok, model = tiny_parts
    settings = EpisodeSettings(max_turns=3, turn_max_new_tokens=6, episode_tokens=C, hold_kv=True)
    before = dict(few_slots.stats)  # the engine is the file's: its counts include other tests' runs
    prompts, results, figures = _run(tiny_parts, few_slots, 9, Scripted(turns=3, delay=0.05), settings)
    for stat in ("held_given_up", "resumed_turns"):
        assert few_slots.stats[stat] - before.get(stat, 0) > 0, stat
    assert figures["turns"] == 27
    rows = [layout(np.array(p), np.array(r.tokens), P, C, tok.pad_id) for p, r in zip(prompts, results)]
    tokens, valid = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    recomputed = np.asarray(sequence_logprobs(model, model.params, tokens, valid, 1.0, tok.pad_id))[:, P - 1:]
    for i, r in enumerate(results):
        mask = np.array(r.model_mask)
        assert np.abs(recomputed[i, :len(mask)][mask] - np.array(r.logprobs)[mask]).max() <= 1e-4


def test_episodes_are_reproducible_and_end_at_their_budget(tiny_parts, engine):
    settings = EpisodeSettings(max_turns=8, turn_max_new_tokens=8, episode_tokens=20)
    _, a, _ = _run(tiny_parts, engine, 6, Scripted(turns=8), settings, rng=3)
    _, b, _ = _run(tiny_parts, engine, 6, Scripted(turns=8, delay=0.01), settings, rng=3)
    assert [r.tokens for r in a] == [r.tokens for r in b]  # scheduling does not change what is sampled
    for r in a:
        assert len(r.tokens) <= 20
        if r.turns < 8:
            assert not r.finished  # ran out of tokens before the environment ended it


def test_an_environment_that_raises_ends_only_its_episode(tiny_parts, engine):
    class Broken(Scripted):
        def start(self, problem):
            episode = super().start(problem)
            if problem.prompt_id.endswith("-1"):
                episode.step = lambda text: 1 / 0
            return episode
    settings = EpisodeSettings(max_turns=3, turn_max_new_tokens=6, episode_tokens=C)
    _, results, _ = _run(tiny_parts, engine, 4, Broken(turns=3), settings)
    assert "ZeroDivisionError" in results[1].error and not results[1].finished and results[1].turns == 1
    assert all(r.error is None and r.turns == 3 for k, r in enumerate(results) if k != 1)


@pytest.mark.parametrize("hold_kv", [False, True], ids=["reprefill", "hold"])
def test_in_flight_weight_updates_go_on_across_turns(tiny_parts, few_slots, hold_kv):
    """A new version every other chunk (of 2 steps): every token of an episode records its version (an observation
    token the version of the model token before it), versions never go back, and episodes span several versions."""
    from tests.mixed_versions import every_other_call, scaled_versions

    cfg, task, tok, model = tiny_parts
    engine = few_slots
    settings = EpisodeSettings(max_turns=3, turn_max_new_tokens=6, episode_tokens=C, hold_kv=hold_kv)
    _, results, _ = _run(tiny_parts, engine, 6, Scripted(turns=3), settings, workers=2,
                         refresh=every_other_call(scaled_versions(model.params, 30, 0.01)))
    for r in results:
        versions, mask = np.array(r.versions), np.array(r.model_mask)
        assert len(versions) == len(r.tokens) and (np.diff(versions) >= 0).all()
        after_model = np.flatnonzero(~mask[1:] & mask[:-1]) + 1  # each observation's first token
        assert (versions[after_model] == versions[after_model - 1]).all()
    assert sum(len(set(r.versions)) > 1 for r in results) >= 3


def test_holding_the_cache_samples_the_same_episodes_as_prefilling_it(tiny_parts, engine):
    """A resumed turn samples from its own key from the first token after the observation, as a prefilled turn does:
    the same episodes either way (a token could differ only where the two caches' last-bit rounding moves a sample
    across a boundary of the inverse CDF: about 1e-6 per token)."""
    runs = {}
    for hold_kv in (False, True):
        settings = EpisodeSettings(max_turns=3, turn_max_new_tokens=8, episode_tokens=C, hold_kv=hold_kv)
        runs[hold_kv] = [r.tokens for r in _run(tiny_parts, engine, 8, Scripted(turns=3), settings, rng=7)[1]]
    assert runs[False] == runs[True]


class Ending:
    """Ends the episode at its first step with reward 1, or (`goes_on`) answers it with an observation."""

    def __init__(self, goes_on: bool):
        self.goes_on = goes_on

    def start(self, problem):
        env = self

        class Episode:
            def step(self, text):
                return Turn(Observation("= 1") if env.goes_on else None, reward=1.0)
        return Episode()


def _one_scripted_turn(tiny_parts, env, settings, sampled: list[int], closed: bool = True):
    """One episode on the real RolloutStream whose engine is a script: its first turn samples `sampled` (closed by
    its last id, the stop token; `closed=False`: cut at its budget). The episode's result (logic only: the engine's
    own runs are the tests above)."""
    from grpo_stream.common.episodes.result import GroupWork
    from grpo_stream.common.episodes.stream import RolloutStream

    cfg, task, tok, _ = tiny_parts
    problem = task.train_problem(0)
    ended = []
    stream = RolloutStream(lambda key, rows: list(range(rows)), ended.append)
    kind = ToolTurns(env, PlainRenderer(tok), settings, tok, 1)
    try:
        stream.start(GroupWork(problem, tok.encode(problem.prompt), 1, None, "g", 0, jax.random.key(0)), kind)
        [request] = stream.take()
        stream.finish(request, sampled, [-0.5] * len(sampled), None, closed)
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        kind.close()
    return ended[0].results[0]


@pytest.mark.parametrize("goes_on", [False, True], ids=["environment-ends-it", "environment-goes-on"])
def test_an_answer_closed_on_the_budgets_last_token_is_finished_if_the_environment_ends_it(tiny_parts, goes_on):
    """The budget check came first: a closed final answer whose stop token was the episode's last budgeted token was
    called truncated, and its turn reward never asked for, while one token more of budget made it finished."""
    tok = tiny_parts[2]
    sampled = tok.encode(" 42") + [tok.eos_id]
    settings = EpisodeSettings(max_turns=4, turn_max_new_tokens=8, episode_tokens=len(sampled))
    result = _one_scripted_turn(tiny_parts, Ending(goes_on), settings, sampled)
    assert result.tokens == sampled and result.turn_closed == [True] and result.turn_rewards == [1.0]
    assert result.finished == (not goes_on)  # no room for the observation: truncated


def test_a_final_answer_cut_at_the_turn_budget_is_truncated_though_the_environment_ends_it(tiny_parts):
    """A turn cut at environment.turn_max_new_tokens that calls no tool ends the episode: it was counted finished
    (not truncated), so algo.overlong kept and scored an answer cut mid-way, while the same cut turn at max_turns
    was truncated."""
    tok = tiny_parts[2]
    sampled = tok.encode(" 4 2 4")
    settings = EpisodeSettings(max_turns=4, turn_max_new_tokens=len(sampled), episode_tokens=C)
    result = _one_scripted_turn(tiny_parts, Ending(goes_on=False), settings, sampled, closed=False)
    assert result.tokens == sampled and result.turn_closed == [False] and result.turn_rewards == [1.0]
    assert not result.finished and result.error is None


def test_an_environment_whose_start_raises_fails_its_group_not_the_sampler(tiny_parts):
    """`Environment.start` raising for one row (a problem the environment cannot set up) was raised on the feeder's
    thread: the sampler stopped with the group's rows held in flight, and its restart met the same problem at the
    same data position. Now the group ends at once, every row failed with the reason, nothing sent to the engine."""
    from grpo_stream.common.episodes.result import GroupWork
    from grpo_stream.common.episodes.stream import RolloutStream

    class StartsTwice(Scripted):
        def start(self, problem):
            self.started = getattr(self, "started", 0) + 1
            if self.started == 3:
                raise KeyError("no such table")
            return super().start(problem)

    cfg, task, tok, _ = tiny_parts
    problem = task.train_problem(0)
    ended = []
    stream = RolloutStream(lambda key, rows: list(range(rows)), ended.append)
    kind = ToolTurns(StartsTwice(turns=2), PlainRenderer(tok), EpisodeSettings(2, 6, C), tok, 1)
    try:
        stream.start(GroupWork(problem, tok.encode(problem.prompt), 4, None, "g", 0, jax.random.key(0)), kind)
    finally:
        kind.close()
    assert [run.work.group_id for run in ended] == ["g"] and stream.take() == []
    assert all("start raised KeyError" in r.failed for r in ended[0].results)
    assert stream.episodes_in_flight == 0 and not stream.in_flight()


class Rewarding:
    """Ends the episode at its first step with the turn reward `reward`."""

    def __init__(self, reward):
        self.reward = reward

    def start(self, problem):
        env = self

        class Episode:
            def step(self, text):
                return Turn(None, reward=env.reward)
        return Episode()


@pytest.mark.parametrize("reward", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_turn_reward_that_is_not_finite_ends_its_episode_with_an_error(tiny_parts, reward):
    """A NaN turn reward was kept: the episode's reward became NaN at any turn_reward_weight (0 x NaN), and the
    ingest refused the whole group (reward must be finite), its data position lost with no word of the environment.
    Now it is the environment's error at that turn, as a step that raises is."""
    from grpo_stream.common.episodes.groups import build_group
    from grpo_stream.common.episodes.result import GroupWork
    from grpo_stream.common.tasks.rewards import DEFAULT_WEIGHTS, RewardSet

    cfg, task, tok, _ = tiny_parts
    sampled = tok.encode(" 42") + [tok.eos_id]
    result = _one_scripted_turn(tiny_parts, Rewarding(reward), EpisodeSettings(4, 8, C), sampled)
    assert "turn reward is" in result.error and not result.finished and result.turn_rewards == []
    problem = task.train_problem(0)
    work = GroupWork(problem, tok.encode(problem.prompt), 1, RewardSet(DEFAULT_WEIGHTS), "g", 0, None)
    assert np.isfinite(build_group(work, [result], "s", tok, turn_weight=0.0).completions[0].reward)


class Exiting:
    """Its step raises SystemExit, as an in-process tool running model-written code that calls exit() does."""

    def start(self, problem):
        class Episode:
            def step(self, text):
                raise SystemExit(3)
        return Episode()


def test_an_environment_step_that_raises_system_exit_ends_its_episode(tiny_parts):
    """SystemExit is no Exception: it escaped the worker (kept in the pool's future), and the episode was neither
    ended nor continued, its group in flight for ever. Now it ends the episode with the error, as any raise does."""
    tok = tiny_parts[2]
    sampled = tok.encode(" 42") + [tok.eos_id]
    result = _one_scripted_turn(tiny_parts, Exiting(), EpisodeSettings(4, 8, C), sampled)
    assert result.error == "SystemExit: 3" and not result.finished and result.tokens == sampled


def test_progress_runs_on_the_serving_thread_when_episodes_end_on_tool_workers(tiny_parts, engine):
    """eval.max_share's pause is the progress callback: called where a group ended (a tool worker here, a verifiers
    event loop there) it paused that thread while the engine decoded on, and the other groups' timers ran on."""
    from grpo_stream.common.episodes.finite import run_groups
    from grpo_stream.common.episodes.result import GroupWork

    cfg, task, tok, model = tiny_parts
    problems = [task.train_problem(i) for i in range(6)]
    works = [GroupWork(p, tok.encode(p.prompt), 2, None, f"g/{i}", i, jax.random.key(i))
             for i, p in enumerate(problems)]
    settings = EpisodeSettings(max_turns=2, turn_max_new_tokens=6, episode_tokens=C)
    kind, threads = ToolTurns(Scripted(turns=2), PlainRenderer(tok), settings, tok, 2), []
    try:
        groups = run_groups(engine, model.params, works, kind, max_rows=4,
                            progress=lambda: threads.append(threading.current_thread()))
    finally:
        kind.close()
    assert all(len(g) == 2 for g in groups)
    assert threads and set(threads) == {threading.main_thread()}, {t.name for t in threads}
