"""What the rollout link works on and makes: a group to make (`GroupWork`) and its finished episodes
(`EpisodeResult`).

Every rollout is an episode: a single-turn completion is an episode of one model turn, a tool environment's rollout
one of several turns with observations between them, a `verifiers` environment's rollout whatever its own loop makes.
Whatever made it, an episode is handed over the same way: the completion's token ids as sampled (and observations as
rendered), their behaviour logprobs, the weight version that drew each token, which tokens the model sampled, and,
for kinds that score their own episodes (a verifiers rubric), the reward and its components. The one group builder
(groups.py) turns a group's episodes into the wire's GroupData.

Keys: row i of a group samples its first turn with `engine.request_keys(work.key, rows)[i]`, exactly the key
`engine.generate` gives row i of `rows` copies of the prompt under `work.key`, so a seeded single-turn group samples
what `generate` samples; turn t >= 1 of row i uses `engine.request_keys(fold_in(work.key, t), rows)[i]`. Keys depend
on the group, never on what else the engine decodes or when.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class GroupWork:
    """One group to make: `rows` episodes of `problem` (its .prompt_id, .prompt, .answer; a verifiers row also has
    .row), starting from `prompt_ids`, sent as `group_id`."""

    problem: Any
    prompt_ids: list[int]
    rows: int
    rewards: Any                     # the RewardSet that scores its episodes (kinds that score themselves ignore it)
    group_id: str
    position: int | None             # its index in the sampler's data stream; None: an injected prompt
    key: Any                         # a JAX key: the group's sampling (module docstring)
    greedy: bool = False             # every turn takes the most likely token (evaluation)
    train: bool = True               # False: an injected prompt asked for evaluation only (answered, not trained)
    budgets: list[int] | None = None  # per row, the first turn's most new tokens (default: the run's limits)
    epoch: str = ""                  # the trainer epoch of the weights it started with (a sampler sends none of
                                     # another epoch: a restarted trainer's version numbers are not the old one's)

    @property
    def injected(self) -> bool:
        return self.position is None


def on_host(key: Any) -> Any:
    """`key` on the host's CPU: what is derived from it there never queues behind the engine's work on an
    accelerator. (Placing the key, rather than a default-device context, keeps one compiled program per key
    operation: a context is part of jit's cache key, and the same program would be compiled again under it.)"""
    return jax.device_put(key, jax.local_devices(backend="cpu")[0])


def turn_rng(work_key: Any, turn: int) -> Any:
    """The key whose engine.request_keys give a group's rows their turn `turn` (turn 0: the group's own key)."""
    key = on_host(work_key)
    return key if turn == 0 else jax.random.fold_in(key, turn)


@dataclasses.dataclass
class EpisodeResult:
    """One finished episode: the completion's tokens after the prompt, as the trainer will see them."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)   # 0 on observation tokens
    model_mask: list[bool] = dataclasses.field(default_factory=list)  # True: sampled by the model
    versions: list[int] = dataclasses.field(default_factory=list)     # per token (an observation: its turn's)
    turn_texts: list[str] = dataclasses.field(default_factory=list)   # each model turn, decoded (when known)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    turn_closed: list[bool] = dataclasses.field(default_factory=list)  # the turn ended with a stop token
    finished: bool = False         # ended by the environment or a stop token (not at a token budget)
    error: str | None = None       # the environment raised: the episode ended there
    reward: float | None = None    # set by kinds that score their own episodes (a verifiers rubric)
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    prompt_ids: list[int] | None = None  # the episode's own first prompt, when its kind renders it (verifiers)
    failed: str | None = None      # it could not become a completion (why): its whole group is left out

    @property
    def turns(self) -> int:
        return len(self.turn_closed)

    @property
    def model_text(self) -> str:
        """The model's turns joined (what an evaluation's examples show; rewards score the final turn: groups.py)."""
        return "\n".join(self.turn_texts)

    def add_turn(self, tokens, logprobs, versions, closed: bool) -> None:
        """A model turn's sampled tokens, their logprobs and versions (None: the turn's were not recorded)."""
        tokens = np.asarray(tokens).tolist()
        self.tokens += tokens
        self.logprobs += np.asarray(logprobs, np.float32).tolist()
        self.model_mask += [True] * len(tokens)
        if versions is not None:
            self.versions += np.asarray(versions).tolist()
        self.turn_closed.append(bool(closed))

    def add_observation(self, ids: list[int]) -> None:
        """An observation's ids (the environment's, rendered once): not sampled, logprob 0, the version of the turn
        they answer."""
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.model_mask += [False] * len(ids)
        if self.versions:
            self.versions += [self.versions[-1]] * len(ids)
