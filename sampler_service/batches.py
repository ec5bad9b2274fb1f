"""What one generation batch holds: injected prompts first (claimed from the ingest), then dataset prompts.

Injected prompts go first so a researcher steering a live run sees results within a batch; each keeps its own
group size and rewards. Dataset prompts fill the rows left, in the order of this sampler's data stream, whose
position names the group and seeds its sampling (a restarted sampler continues the same sequence).

An injected prompt's reward names come from whoever wrote the prompt (the ingest checks them, but Redis can be written
by others): they are looked up among the run's rewards only (`RunRewards`), never imported, and a prompt naming
another is skipped, not generated.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import types
from typing import Iterator

import grpc

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.tasks.rewards import RewardSet, RunRewards, UnknownReward
from grpo_stream.protos import rollout_pb2

log = logging.getLogger(__name__)
MAX_SKIPPED_PROMPTS = 1000  # consecutive over-long prompts before the sampler gives up (config is wrong)


@dataclasses.dataclass
class Slot:
    """One prompt of a generation batch: `rows` completions scored by `rewards`, sent as group `group_id`;
    `position` is its index in the data stream (None: an injected prompt)."""

    problem: object
    ids: list[int]
    rows: int
    rewards: RewardSet
    group_id: str
    position: int | None
    train: bool = True  # False: an injected prompt asked for evaluation only (its group is answered, not trained)


class BatchBuilder:
    """Fills generation batches for one sampler. `prompts` yields (data position, problem) from the sampler's
    stream; `ingest_stub` (set once connected; None: no injected prompts) is where injected prompts are claimed."""

    def __init__(self, cfg: RunConfig, sampler_id: str, tokenizer, prompts: Iterator, default: RewardSet):
        self.cfg, self.sampler_id, self.tokenizer, self.prompts, self.default = (cfg, sampler_id, tokenizer, prompts,
                                                                                 default)
        self.ingest_stub = None
        self.pending: collections.deque = collections.deque()  # claimed injected prompts not generated yet
        self.injected_done = self.injected_refused = 0
        self.rewards = RunRewards(default, cfg.task.rewards)
        self._claim_warned = False

    def next_batch(self, groups: int, version: int) -> list[Slot]:
        """Slots for `groups` groups' worth of rows (generation.num_generations each): injected prompts that fit,
        then dataset prompts. Prompts over generation.max_prompt_tokens are skipped with a warning."""
        gen = self.cfg.generation
        batch = self.injected_slots(groups * gen.num_generations, version)
        rows = sum(slot.rows for slot in batch)
        skipped_in_a_row = 0
        while rows + gen.num_generations <= groups * gen.num_generations:
            position, problem = next(self.prompts)
            ids = self.tokenizer.encode(problem.prompt)
            if len(ids) > gen.max_prompt_tokens:
                skipped_in_a_row += 1
                if skipped_in_a_row > MAX_SKIPPED_PROMPTS:
                    raise ValueError(f"generation.max_prompt_tokens={gen.max_prompt_tokens}: the last "
                                     f"{skipped_in_a_row} prompts were all longer; raise it")
                log.warning("prompt %s has %d tokens > generation.max_prompt_tokens; skipped", problem.prompt_id,
                            len(ids))
                continue
            skipped_in_a_row = 0
            batch.append(Slot(problem, ids, gen.num_generations, self.default,
                              f"{self.cfg.run.name}/{self.sampler_id}/{position}", position))
            rows += gen.num_generations
        return batch

    def injected_slots(self, free_rows: int, version: int) -> list[Slot]:
        """Injected prompts for the next batch: what is left from the last claim, topped up by a new one. A prompt
        that does not fit the rows left waits for the next batch; an unreachable ingest only means dataset
        prompts (claims resume later)."""
        wanted = self.cfg.sampler.prompts_per_batch - len(self.pending)
        if wanted > 0 and self.ingest_stub is not None:
            try:
                reply = self.ingest_stub.ClaimPrompts(rollout_pb2.ClaimRequest(
                    sampler_id=self.sampler_id, max_prompts=wanted, policy_version=version), timeout=5)
                self.pending.extend(reply.prompts)
                self._claim_warned = False
            except grpc.RpcError as exc:
                if not self._claim_warned:
                    log.warning("%s: cannot claim injected prompts (%s); generating dataset prompts", self.sampler_id,
                                exc.code().name)
                    self._claim_warned = True
        slots, rows = [], 0
        while self.pending and rows + self.pending[0].num_generations <= free_rows:
            p = self.pending.popleft()
            try:
                rewards = self.rewards.subset(list(p.rewards))
            except UnknownReward as exc:
                self.injected_refused += 1
                log.warning("%s: injected prompt %r not generated: %s (the ingest refuses these: does its "
                            "task.rewards differ from this sampler's?)", self.sampler_id, p.prompt_id[:64], exc)
                continue
            problem = types.SimpleNamespace(prompt_id=p.prompt_id, answer=p.reference_answer)
            slots.append(Slot(problem, list(p.prompt_token_ids), p.num_generations, rewards,
                              f"{self.cfg.run.name}/inj/{p.prompt_id}", None, p.train))
            rows += p.num_generations
        self.injected_done += len(slots)
        return slots
