"""The multi-turn CPU demo's task: the addition problems of arith.py, answered with a calculator tool.

An expert first calls the tool, `<call>add(a, b)</call>`, reads its answer (` = c`, written by the environment,
common/environments/arith_tools.py) and then states ` #### c`. The warm start's demonstrations do that only part of
the time: otherwise they answer at once and, as in arith.py, forget the units carry (`a + b = c #### c`, wrong on
carry problems). A warm-started model therefore calls the tool on some problems and guesses on others; episodes
that call it are right, and GRPO learns to call it (docs/environments.md).
"""

from __future__ import annotations

import dataclasses
import random

from grpo_stream.common.tasks.arith import ArithTask, Problem, plain_prompt, with_tokenizer

TOOL_NAME = "add"


def call_text(a: int, b: int) -> str:
    """The model's tool-calling turn (the 'plain' tool format)."""
    return f" <call>{TOOL_NAME}({a}, {b})</call>"


def result_text(value: str) -> str:
    """The environment's observation after a call: the tool's answer (PlainRenderer puts a space before it)."""
    return f"= {value}"


@dataclasses.dataclass(frozen=True)
class ToolProblem(Problem):
    def demonstration_segments(self, use_tool: bool, drop_carry: bool) -> list[tuple[str, bool]]:
        """A teacher's episode as (text, written by the model) segments; each model segment ends its turn with the
        stop token. With `use_tool` the tool is called; else the answer is guessed (with `drop_carry`: wrongly on
        a carry problem)."""
        if not use_tool:
            return [(self.demonstration(drop_carry=drop_carry), True)]
        total = self.a + self.b
        return [(call_text(self.a, self.b), True), (" " + result_text(str(total)), False), (f" #### {total}", True)]


class ArithToolsTask(ArithTask):
    """ArithTask whose problems carry tool-using demonstrations."""

    def _problem(self, rng: random.Random, a: int, b: int, prompt_id: str) -> ToolProblem:
        base = super()._problem(rng, a, b, prompt_id)
        return ToolProblem(prompt_id=base.prompt_id, a=base.a, b=base.b, question=base.question, prompt=base.prompt)

    def corpus(self, size: int) -> list[str]:
        """Tokenizer text: prompts with direct answers, tool calls, the tool's answers and error observations."""
        rng = random.Random(f"{self.seed}/corpus-tools")
        out = super().corpus(size // 2)
        for k in range(size - len(out)):
            p = self._problem(rng, rng.randint(self.min_operand, self.max_operand),
                              rng.randint(self.min_operand, self.max_operand), f"corpus-tools-{k}")
            text = "".join(t for t, _ in p.demonstration_segments(use_tool=True, drop_carry=False))
            out.append(plain_prompt(p.question) + text + (" = error" if k % 7 == 0 else ""))
        return out


def build(cfg, hf_tokenizer):
    """The task registry's entry (task.name=arith_tools)."""
    t = cfg.task
    return with_tokenizer(cfg, ArithToolsTask(t.min_operand, t.max_operand, t.heldout_fraction, cfg.run.seed),
                          hf_tokenizer)
