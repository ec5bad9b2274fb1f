"""The environment link: multi-turn episodes that talk back (tool results, user replies) between model turns.

An environment starts an `Episode` from a problem (the task's: its prompt and reference answer). After every model
turn the episode gets the turn's decoded text and answers with a `Turn`: an observation message for the model (a
tool's result, a user message) or None to end the episode, and optionally a reward for that turn. The episode's
reward is the run's weighted rewards (task.rewards) on the text of its model turns, plus
environment.turn_reward_weight x the sum of its turn rewards. A single-turn task is the case of an episode that
ends after its first turn; with environment.name unset the sampler runs single-turn tasks as it always has.

Token in, token out: the model's tokens stay exactly as sampled. Each observation is rendered by the model's chat
template (render.py) and tokenized once, appended after the model's tokens; earlier turns are never re-encoded
(decoding and re-encoding a sampled turn can give other ids, and the trainer would then score tokens the sampler
never drew). Environments are chosen by environment.name in common/registry/environments.py.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the environment says to the model: a chat message's role ('tool' for a tool's result, 'user') and
    content. `parts`, when it holds several texts (the results of a turn's several tool calls), are each a message of
    `role`, as a chat template writes one tool message per call (Qwen: a <tool_response> each); `content` is then
    them joined, written as one message where the template takes no run of such messages (Gemma's user turn) and
    where there is no template (the tiny model)."""
    content: str
    role: str = "tool"
    parts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Turn:
    """The environment's answer to a model turn: an observation, or None to end the episode; and a turn reward."""
    observation: Observation | None
    reward: float = 0.0


class Episode(Protocol):
    def step(self, turn_text: str) -> Turn:
        """The model's turn (decoded, stop token removed) -> the environment's answer. Runs on a worker thread, off
        the decode path; may block (a tool call, a simulated user)."""


class Environment(Protocol):
    def start(self, problem) -> Episode:
        """A new episode for `problem` (has .prompt_id, .prompt, .answer); one per completion of a group."""
