"""The task and reward links: where prompts come from, and how a completion is scored.

A task gives each sampler its shard of training problems in a fixed order (so a restarted sampler continues where
it stopped) and everyone the same held-out problems. A problem has a `prompt_id`, the rendered `prompt` and the
reference `answer`. A reward is a pure function (completion text, reference answer) -> float; a run weights
several (task.rewards). Tasks are chosen by task.name in common/registry/tasks.py, rewards by name in
tasks/rewards.py: REWARDS (or any `package.module:function`).
"""

from __future__ import annotations

from typing import Iterator, Protocol

THINK_END = "</think>"  # where a reasoning model's thinking (Qwen3, DeepSeek-R1, QwQ) ends and its reply begins


class Problem(Protocol):
    prompt_id: str

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str: ...


class Task(Protocol):
    def render_question(self, question: str) -> str:
        """An injected question as this task's prompt."""

    def train_stream(self, index: int, count: int, start: int = 0) -> Iterator[Problem]:
        """Shard `index` of `count` of the training problems, from data position `start`, endlessly."""

    def heldout(self, n: int) -> list[Problem]:
        """The first `n` held-out problems (the same in every process)."""

    def split_problems(self, split: str, limit: int) -> list[Problem]:
        """The first `limit` problems of a named split (`grpo-stream eval --split`)."""


class RewardFn(Protocol):
    def __call__(self, text: str, reference: str) -> float: ...


def reply(text: str) -> str:
    """What a completion answers, which the built-in rewards score: the text after its last `</think>`, or all of it
    when it has none. A reasoning model's thinking holds drafts ("so the answer is 17. Wait...") that the rewards
    read first: the first statement of an answer wins (answers.extract_answer), and an IFEval check counted the
    thinking's words and commas. lm-eval scores such a model's reply alone the same way (its think_end_token)."""
    return text.rpartition(THINK_END)[2]
