"""An observation far longer than the episode's tokens left is not tokenized: a custom environment's observation of
unbounded size (a tool answering with a whole file) was rendered and tokenized whole on a worker (its time, and the
memory of its ids), only for the episode to end at its budget."""

import jax

from grpo_stream.common.environments.base import Observation, Turn
from grpo_stream.common.environments.render import PlainRenderer
from grpo_stream.common.episodes.result import GroupWork
from grpo_stream.common.episodes.stream import RolloutStream
from grpo_stream.common.episodes.tool_turns import MAX_CHARS_PER_TOKEN, EpisodeSettings, ToolTurns
from tests.support import wait_for

EPISODE_TOKENS = 40


class Answering:
    """Answers the first turn with `content` (as one message, or `split` in two parts)."""

    def __init__(self, content: str, split: bool = False):
        self.content, self.split = content, split

    def start(self, problem):
        env = self

        class Episode:
            def step(self, text):
                half = len(env.content) // 2
                parts = (env.content[:half], env.content[half:]) if env.split else ()
                return Turn(Observation(env.content, parts=parts), reward=1.0)
        return Episode()


class Recording:
    """The tokenizer as the renderer sees it: the length of every text it encodes recorded."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, []

    def encode(self, text):
        self.encoded.append(len(text))
        return self.tokenizer.encode(text)


def _first_turn(tiny_parts, env):
    """(the episode's result, the lengths of the texts the renderer tokenized) after its first turn's answer."""
    cfg, task, tok, _ = tiny_parts
    problem = task.train_problem(0)
    ended, recording = [], Recording(tok)
    stream = RolloutStream(lambda key, rows: list(range(rows)), ended.append)
    settings = EpisodeSettings(max_turns=2, turn_max_new_tokens=8, episode_tokens=EPISODE_TOKENS)
    kind = ToolTurns(env, PlainRenderer(recording), settings, tok, workers=1)
    sampled = tok.encode(" 42") + [tok.eos_id]
    try:
        stream.start(GroupWork(problem, tok.encode(problem.prompt), 1, None, "g", 0, jax.random.key(0)), kind)
        [request] = stream.take()
        stream.finish(request, sampled, [-0.5] * len(sampled), None, True)
        wait_for(lambda: ended or stream.wants_engine(), 30, "the episode to end or take its next turn")
    finally:
        kind.close()
    return (ended[0].results[0] if ended else None), recording.encoded


def test_an_observation_far_past_the_episodes_room_is_not_tokenized(tiny_parts):
    for split in (False, True):
        result, encoded = _first_turn(tiny_parts, Answering("7 " * (EPISODE_TOKENS * MAX_CHARS_PER_TOKEN), split))
        assert encoded == [], encoded  # nothing tokenized
        assert result is not None and not result.finished and result.error is None and result.turn_rewards == [1.0]


def test_an_observation_that_fits_is_answered_as_before(tiny_parts):
    result, encoded = _first_turn(tiny_parts, Answering("= 5"))
    assert result is None and len(encoded) == 1  # tokenized once, the episode went on to its next turn
