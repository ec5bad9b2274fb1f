"""Single-turn rollouts (a task without an environment): each episode is one model turn, ended by a stop token or
its budget. Its first turn is the row's engine.generate key (result.py), so a seeded group samples what `generate`
samples for it."""

from __future__ import annotations

from grpo_stream.common.engine.base import Request
from grpo_stream.common.episodes.result import EpisodeResult
from grpo_stream.common.episodes.stream import GroupRun


class _Row:
    """The turn owner of one row: its one turn is its episode."""

    def __init__(self, run: GroupRun, row: int):
        self.run, self.row = run, row

    def turn_done(self, request: Request, tokens, logprobs, versions, finished: bool) -> None:
        result = EpisodeResult()
        result.add_turn(tokens, logprobs, versions, finished)
        result.finished = bool(finished)
        self.run.episode_done(self.row, result)


class SingleTurn:
    """The rollout kind of single-turn tasks; `max_new_tokens`: a row's budget (generation.max_new_tokens) unless
    the group gives its own."""

    def __init__(self, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens
        self.environment_seconds = 0.0  # no environment

    def start(self, run: GroupRun) -> None:
        work = run.work
        for row in range(work.rows):
            budget = work.budgets[row] if work.budgets is not None else self.max_new_tokens
            run.stream.submit(Request(ids=list(work.prompt_ids), budget=int(budget), key=run.key(row, 0),
                                      tag=_Row(run, row), greedy=work.greedy))

    def close(self) -> None:
        return None


def build(cfg, task, tokenizer, routes=None) -> SingleTurn:
    """The rollout registry's entry (single_turn)."""
    return SingleTurn(cfg.generation.max_new_tokens)
