"""Held-out evaluation: greedy pass@1 with the sampling engine."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from common.generation import Engine
from common.rewards import answer_correct, answer_format
from common.tasks.arith import Problem
from common.tokenizer import TextTokenizer


@dataclasses.dataclass
class EvalResult:
    accuracy: float
    format_rate: float
    num_problems: int
    seconds: float
    examples: list[dict]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def evaluate(engine: Engine, params: Any, tokenizer: TextTokenizer, problems: list[Problem], batch_size: int,
             num_examples: int = 3) -> EvalResult:
    start = time.time()
    correct = formatted = 0
    examples = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        # pad the last batch to the full size: one compiled shape
        prompts = [tokenizer.encode(p.prompt) for p in chunk]
        prompts += [prompts[-1]] * (batch_size - len(prompts))
        out = engine.generate(params, prompts, jax.random.key(0), greedy=True)
        for j, problem in enumerate(chunk):
            text = tokenizer.decode(out.tokens[j, :out.lengths[j]].tolist())
            ok = answer_correct(text, problem.answer)
            correct += ok
            formatted += answer_format(text, problem.answer)
            if len(examples) < num_examples:
                examples.append({"prompt": problem.prompt, "completion": text, "answer": problem.answer,
                                 "correct": bool(ok)})
    n = len(problems)
    return EvalResult(accuracy=correct / n, format_rate=formatted / n, num_problems=n,
                      seconds=round(time.time() - start, 3), examples=examples)
