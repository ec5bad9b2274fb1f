"""Addition word problems in GSM8K answer format: the CPU demo task.

A problem is two operands in a short story; the answer a model must write is
`a + b = c #### c`. Ordered operand pairs are split once, by a hash, into a
training part and a held-out part, so evaluation never sees a training pair in
its order; its swapped pair (b, a) usually is a training one (the split, and the
learning checks calibrated on it, predate noticing: the held-out figures
measure carrying on unseen ordered pairs, not on unseen operand sets).

The supervised warm start uses demonstrations that forget the carry from
the units into the tens with probability `carry_drop_prob` (47 + 38 = 75). A model trained on them is
right on carry-free problems, often wrong on carry problems under greedy
decoding, and sometimes right when sampling: the regime where GRPO has a
signal and can raise held-out accuracy (see docs/operations.md, "The CPU demo").
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from typing import Callable, Iterator

from grpo_stream.common.tasks import prompts
from grpo_stream.common.tasks.task_tokenizer import build_tokenizer

_NAMES = ("Tom", "Ana", "Ben", "Mia", "Sam", "Zoe", "Leo", "Ivy")
_ITEMS = ("apples", "coins", "books", "cards", "shells", "stamps", "pens", "eggs")
_TEMPLATES = (
    "{n} has {a} {i} and gets {b} more. How many {i} now?",
    "A box has {a} {i}. {n} adds {b}. How many {i} in the box?",
    "{n} found {a} {i} and then {b} more. How many in all?",
)
PROMPT_FORMAT = prompts.PLAIN  # the tiny tokenizer's corpus, and the prompts of task.prompt_template=plain
TEMPLATES = ("plain", "chat", "reasoning")  # the tools template lists gsm8k_tools's tools, not this task's
LISTED_PAIRS = 1 << 22  # ranges with more ordered pairs (operands past 2048 values) draw held-out pairs
SCANNED_PAIRS = 4096  # operand ranges of at most this many ordered pairs are checked for a training pair


def plain_prompt(question: str) -> str:
    """The plain template's prompt for a tokenizer without BOS text (the tiny model's)."""
    return PROMPT_FORMAT.format(question=question)


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt_id: str
    a: int
    b: int
    question: str
    prompt: str  # the question rendered by the run's task.prompt_template (common/tasks/prompts.py)

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def demonstration(self, drop_carry: bool = False) -> str:
        """The completion text a teacher writes; with `drop_carry`, the units carry is forgotten."""
        c = _sum_forgetting_units_carry(self.a, self.b) if drop_carry else self.a + self.b
        return f" {self.a} + {self.b} = {c} #### {c}"

    def has_carry(self) -> bool:
        return _sum_forgetting_units_carry(self.a, self.b) != self.a + self.b


def _sum_forgetting_units_carry(a: int, b: int) -> int:
    return a + b - 10 if a % 10 + b % 10 >= 10 else a + b


class ArithTask:
    """Deterministic problem source for one run (seeded) with a fixed held-out split."""

    def __init__(self, min_operand: int, max_operand: int, heldout_fraction: float, seed: int,
                 render: Callable[[str], str] = plain_prompt):
        """`render`: question -> prompt text (prompts.renderer of the run's config; the tiny model's plain format by
        default)."""
        self.min_operand, self.max_operand = min_operand, max_operand
        self.heldout_fraction, self.seed, self.render = heldout_fraction, seed, render
        self._check_training_pairs()

    def _check_training_pairs(self) -> None:
        """A narrow operand range can hold out every ordered pair, and train_problem would draw forever (the samplers
        and the warm start hang, saying nothing). Ranges of up to SCANNED_PAIRS pairs are checked; a wider one holds a
        training pair but for odds below 2**-SCANNED_PAIRS (each pair is held out with probability under 1/2)."""
        values = range(self.min_operand, self.max_operand + 1)
        if len(values) ** 2 <= SCANNED_PAIRS and all(self.is_heldout(a, b) for a in values for b in values):
            raise ValueError(f"task.heldout_fraction={self.heldout_fraction} holds out all {len(values) ** 2} operand "
                             f"pairs of task.min_operand={self.min_operand}..task.max_operand={self.max_operand}, "
                             "leaving none to train on: widen the range or lower task.heldout_fraction")

    def render_question(self, question: str) -> str:
        """A bare question wrapped as the run's prompts are (for injected prompts)."""
        return self.render(question)

    def is_heldout(self, a: int, b: int) -> bool:
        return zlib.crc32(f"{a}+{b}".encode()) % 10_000 < self.heldout_fraction * 10_000

    def _problem(self, rng: random.Random, a: int, b: int, prompt_id: str) -> Problem:
        template = rng.choice(_TEMPLATES)
        question = template.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), a=a, b=b)
        return Problem(prompt_id=prompt_id, a=a, b=b, question=question, prompt=self.render(question))

    def train_problem(self, index: int) -> Problem:
        """Training problem number `index` (any non-negative int; the stream is endless)."""
        rng = random.Random(f"{self.seed}/train/{index}")
        while True:
            a = rng.randint(self.min_operand, self.max_operand)
            b = rng.randint(self.min_operand, self.max_operand)
            if not self.is_heldout(a, b):
                return self._problem(rng, a, b, f"arith-train-{index}")

    def train_stream(self, shard: int, num_shards: int, start: int = 0) -> Iterator[Problem]:
        """Problems index ≡ shard (mod num_shards), from `start` on: one sampler's shard."""
        index = start * num_shards + shard
        while True:
            yield self.train_problem(index)
            index += num_shards

    def heldout(self, limit: int) -> list[Problem]:
        """The first `limit` held-out problems in a fixed order (same for every process): of every held-out pair,
        shuffled; in a range of over LISTED_PAIRS ordered pairs, distinct held-out pairs drawn at random (listing
        them took minutes at four-digit operands, at every evaluation, and never ended at task.max_operand's bound)."""
        rng = random.Random(f"{self.seed}/heldout")
        span = self.max_operand - self.min_operand + 1
        listed = span * span <= LISTED_PAIRS
        pairs = self._listed_heldout_pairs(rng) if listed else self._drawn_heldout_pairs(rng, limit)
        if limit > len(pairs):
            raise ValueError(f"{limit} held-out problems asked for (eval.num_problems, or `grpo-stream eval "
                             f"--limit`), but there are {len(pairs)} held-out operand pairs; ask for fewer or widen "
                             "task.min_operand..task.max_operand")
        return [self._problem(rng, a, b, f"arith-heldout-{k}") for k, (a, b) in enumerate(pairs[:limit])]

    def _listed_heldout_pairs(self, rng: random.Random) -> list[tuple[int, int]]:
        values = range(self.min_operand, self.max_operand + 1)
        pairs = [(a, b) for a in values for b in values if self.is_heldout(a, b)]
        rng.shuffle(pairs)
        return pairs

    def _drawn_heldout_pairs(self, rng: random.Random, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` distinct held-out pairs, drawn uniformly (a pair is held out with probability
        heldout_fraction, so `limit / heldout_fraction` draws are expected; twenty times that are allowed)."""
        pairs: dict[tuple[int, int], None] = {}  # ordered: the order drawn
        for _ in range(int(20 * limit / self.heldout_fraction) + 1000):
            if len(pairs) >= limit:
                break
            pair = (rng.randint(self.min_operand, self.max_operand), rng.randint(self.min_operand, self.max_operand))
            if self.is_heldout(*pair):
                pairs[pair] = None
        return list(pairs)

    def split_problems(self, split: str, limit: int) -> list[Problem]:
        """The first `limit` problems of `split` (`grpo-stream eval --split`)."""
        if split == "test":
            return self.heldout(limit)
        if split == "train":
            return [self.train_problem(i) for i in range(limit)]
        raise ValueError(f"--split {split}: the arith task has the splits train and test")

    def corpus(self, size: int) -> list[str]:
        """Text for training the tokenizer: prompts with right and wrong demonstrations."""
        rng = random.Random(f"{self.seed}/corpus")
        out = []
        for k in range(size):
            a = rng.randint(self.min_operand, self.max_operand)
            b = rng.randint(self.min_operand, self.max_operand)
            p = self._problem(rng, a, b, f"corpus-{k}")
            out.append(plain_prompt(p.question) + p.demonstration(drop_carry=bool(k % 2)))
        return out


def build_task(cfg) -> ArithTask:
    t = cfg.task
    return ArithTask(t.min_operand, t.max_operand, t.heldout_fraction, cfg.run.seed)


def build(cfg, hf_tokenizer):
    """The task registry's entry (task.name=arith): the task, and the checkpoint's tokenizer or a BPE trained on
    the task's text; prompts rendered by task.prompt_template with that tokenizer."""
    return with_tokenizer(cfg, build_task(cfg), hf_tokenizer)


def with_tokenizer(cfg, task: ArithTask, hf_tokenizer):
    """(task, tokenizer): the checkpoint's tokenizer, or a BPE trained on the task's plain text (its corpus); then
    the task renders its prompts by task.prompt_template with it."""
    tokenizer = hf_tokenizer or build_tokenizer(cfg, task)
    task.render = prompts.renderer(cfg, tokenizer, templates=TEMPLATES)
    return task, tokenizer
