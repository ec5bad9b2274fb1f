"""The groups a sampler starts next, as room frees in its rollout stream: injected prompts first (claimed from the
ingest), then dataset prompts.

Injected prompts go first so a researcher steering a live run sees results as soon as rows free; each keeps its own
group size and rewards. Dataset prompts fill the rows left, in the order of this sampler's data stream, whose
position names the group and seeds its sampling: its key is fold_in(sampler key, position), so a restarted sampler
continues the same sequence and a group samples the same whatever else the engine decodes beside it.

An injected prompt's reward names come from whoever wrote the prompt (the ingest checks them, but Redis can be written
by others): they are looked up among the run's rewards only (`RunRewards`), never imported, and a prompt naming
another is skipped, not generated. So is one this sampler cannot start (`_refusal`): no rows (a group that never
ends, held for the sampler's life), more rows than it starts as one group, or a prompt empty or longer than its
generation.max_prompt_tokens (the engine raises on it, which would stop the sampler, and the claim's lease would
hand it out again: a crash loop). There is no call to answer the ingest with a refusal: the claim's lease hands the
prompt out again until the ingest's prompts.max_claims gives it up.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
import types
from typing import Iterator

import grpc
import jax

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.episodes.result import GroupWork, on_host
from grpo_stream.common.rpc.grpc_util import MAX_CLAIM
from grpo_stream.common.runtime.errors import SetupError
from grpo_stream.common.tasks.rewards import RewardSet, RunRewards, UnknownReward
from grpo_stream.protos import rollout_pb2

log = logging.getLogger(__name__)
MAX_SKIPPED_PROMPTS = 1000  # consecutive over-long prompts before the sampler gives up (config is wrong)
MAX_REFUSALS_LOGGED = 1000  # distinct injected prompts whose refusal is logged (one claimed again: counted only)
INJECTED_KEYS = 2**31 - 1  # the key stream of injected groups (fold_in of the sampler's key; data positions are less)
CLAIM_EVERY_S = 0.25  # most often the ingest is asked for injected prompts while none is held



def resumed_prompts(task, index: int, count: int, start: int,
                    unanswered: tuple[int, ...] = ()) -> Iterator[tuple[int, object]]:
    """(data position, problem) of this sampler's stream (shard `index` of `count`): the `unanswered` positions
    below `start` first (ascending; read from the stream from the lowest of them on), then every position from
    `start` on. A problem's position is its place in the stream, whichever order it is generated in."""
    if unanswered:
        wanted, lowest = set(unanswered), unanswered[0]
        for position, problem in zip(itertools.count(lowest), task.train_stream(index, count, lowest)):
            if position in wanted:
                yield position, problem
            if position >= unanswered[-1]:
                break
    yield from zip(itertools.count(start), task.train_stream(index, count, start))

class GroupSource:
    """Makes one sampler's groups. `prompts` yields (data position, problem) from the sampler's stream; `key`: the
    sampler's JAX key; `ingest_stub` (set once connected; None: no injected prompts) is where injected prompts are
    claimed."""

    def __init__(self, cfg: RunConfig, sampler_id: str, tokenizer, prompts: Iterator, default: RewardSet, key):
        self.cfg, self.sampler_id, self.tokenizer, self.prompts, self.default = (cfg, sampler_id, tokenizer, prompts,
                                                                                 default)
        self.key = key
        self.ingest_stub = None
        self.pending: collections.deque = collections.deque()  # claimed injected prompts not started yet
        self.injected_done = self.injected_refused = 0
        self.rewards = RunRewards(default, cfg.task.rewards, task_name=cfg.task.name)
        self._claim_warned = False
        self._refusals_logged: set[str] = set()
        self._last_claim = -CLAIM_EVERY_S

    def _key(self, stream: int, index: int):
        key = on_host(self.key)
        return jax.random.fold_in(key if stream < 0 else jax.random.fold_in(key, stream), index)

    def next_groups(self, groups: int, rows: int, version: int) -> list[GroupWork]:
        """At most `groups` groups of at most `rows` rows in all: injected prompts that fit (each its own size),
        then dataset prompts (generation.num_generations rows each), none while an injected prompt waits for rows.
        Prompts over generation.max_prompt_tokens are skipped with a warning."""
        gen = self.cfg.generation
        batch = self.injected_groups(rows, groups, version)
        if self.pending:  # the next injected prompt waits for rows to free: they are kept for it, not given away
            return batch
        used = sum(work.rows for work in batch)
        rows = min(rows, used + (groups - len(batch)) * gen.num_generations)
        skipped_in_a_row, last_skipped = 0, None
        while len(batch) < groups and used + gen.num_generations <= rows:
            position, problem = next(self.prompts)
            ids = self.tokenizer.encode(problem.prompt)
            if not ids or len(ids) > gen.max_prompt_tokens:  # an empty one the engine cannot start either
                # in a row in the data stream: a resumed one hands out its unanswered positions first, the over-long
                # ones skipped before among them, one after another (counted, every restart of a dataset with a
                # quarter of its prompts over the limit failed)
                consecutive = last_skipped is not None and position == last_skipped + 1
                skipped_in_a_row = skipped_in_a_row + 1 if consecutive else 1
                last_skipped = position
                if skipped_in_a_row > MAX_SKIPPED_PROMPTS:
                    # permanent: a restarted sampler resumes at these same positions and meets the same prompts (a
                    # ValueError was restarted by `up` again and again until its restart budget ran out)
                    raise SetupError(f"generation.max_prompt_tokens={gen.max_prompt_tokens}: the last "
                                     f"{skipped_in_a_row} prompts were all empty or longer; raise it or fix the data")
                log.warning("prompt %s has %d tokens (none, or over generation.max_prompt_tokens); skipped",
                            problem.prompt_id, len(ids))
                continue
            skipped_in_a_row = 0
            batch.append(GroupWork(problem, ids, gen.num_generations, self.default,
                                   f"{self.cfg.run.name}/{self.sampler_id}/{position}", position,
                                   self._key(-1, position)))
            used += gen.num_generations
        return batch

    def injected_rows_waiting(self) -> int:
        """Rows of the claimed injected prompt next in line (0: none): the feeder keeps rows free until it fits."""
        self._skip_unstartable()
        return self.pending[0].num_generations if self.pending else 0

    def injected_groups(self, free_rows: int, groups: int, version: int) -> list[GroupWork]:
        """Injected prompts to start now: what is left from the last claim, topped up by a new one (at most every
        CLAIM_EVERY_S). A prompt that does not fit the rows left waits for rows to free; an
        unreachable ingest only means dataset prompts (claims resume later)."""
        wanted = groups - len(self.pending)
        now = time.monotonic()
        if wanted > 0 and self.ingest_stub is not None and now - self._last_claim >= CLAIM_EVERY_S:
            self._last_claim = now
            try:
                reply = self.ingest_stub.ClaimPrompts(rollout_pb2.ClaimRequest(
                    sampler_id=self.sampler_id, max_prompts=min(wanted, MAX_CLAIM),
                    policy_version=version), timeout=5)
                self.pending.extend(reply.prompts)
                self._claim_warned = False
            except grpc.RpcError as exc:
                if not self._claim_warned:
                    log.warning("%s: cannot claim injected prompts (%s); generating dataset prompts", self.sampler_id,
                                exc.code().name)
                    self._claim_warned = True
        works, rows = [], 0
        self._skip_unstartable()
        while self.pending and len(works) < groups and rows + self.pending[0].num_generations <= free_rows:
            p = self.pending.popleft()
            try:
                rewards = self.rewards.subset(list(p.rewards))
            except UnknownReward as exc:
                self._refuse(p, f"{exc} (the ingest refuses these: does its task.rewards differ from this sampler's?)")
                continue
            problem = types.SimpleNamespace(prompt_id=p.prompt_id, answer=p.reference_answer, prompt="")
            works.append(GroupWork(problem, list(p.prompt_token_ids), p.num_generations, rewards,
                                   f"{self.cfg.run.name}/inj/{p.prompt_id}", None,
                                   self._key(INJECTED_KEYS, self.injected_done + len(works)), train=p.train))
            rows += p.num_generations
            self._skip_unstartable()
        self.injected_done += len(works)
        return works

    def _skip_unstartable(self) -> None:
        """Drop claimed prompts at the head of the line this sampler cannot start (`_refusal`): waiting for rows that
        never free would stop every prompt after them, and every dataset prompt; the others would never end or would
        stop the engine."""
        while self.pending:
            why = self._refusal(self.pending[0])
            if why is None:
                return
            self._refuse(self.pending.popleft(), why)

    def _refusal(self, p: rollout_pb2.InjectedPrompt) -> str | None:
        """Why this sampler cannot start injected prompt `p` (None: it can). The ingest checks these against its own
        config, but Redis can be written by others and the ingest's config can differ from this sampler's."""
        most, longest = self.cfg.largest_group(), self.cfg.generation.max_prompt_tokens
        if p.num_generations < 1:
            return f"num_generations {p.num_generations}: a group needs at least 1 row (one of none would never end)"
        if p.num_generations > most:
            return (f"{p.num_generations} rows, and this sampler starts at most {most} as one group "
                    "(sampler.rows_in_flight and the engine's slots: does the ingest's config differ from this "
                    "sampler's?)")
        if not 1 <= len(p.prompt_token_ids) <= longest:
            return (f"prompt_token_ids: {len(p.prompt_token_ids)} tokens, and this sampler starts prompts of 1 to "
                    f"{longest} (generation.max_prompt_tokens: does the ingest's config differ from this sampler's?)")
        vocab = self.tokenizer.vocab_size
        if max(p.prompt_token_ids) >= vocab or min(p.prompt_token_ids) < 0:  # the model would read another row of
            return (f"prompt_token_ids: ids outside 0..{vocab - 1}, this sampler's vocabulary (model.path: does "  # its
                    "the ingest's tokenizer differ from this sampler's?)")  # embedding table: no error, wrong text
        return None

    def _refuse(self, p: rollout_pb2.InjectedPrompt, why: str) -> None:
        """Count `p` as not generated; log why once per prompt (the claim's lease hands it out again)."""
        self.injected_refused += 1
        if p.prompt_id not in self._refusals_logged and len(self._refusals_logged) < MAX_REFUSALS_LOGGED:
            self._refusals_logged.add(p.prompt_id)
            log.warning("%s: injected prompt %r not generated: %s", self.sampler_id, p.prompt_id[:64], why)
