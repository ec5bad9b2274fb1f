"""The config sections of the task: its problems, their data source, its prompt template and rewards (task.*).
The other sections of what is learned are in learning.py; the whole RunConfig in schema.py."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.verifiers_settings import VerifiersSection
from grpo_stream.common.config.base import FilePath, Strict
from grpo_stream.common.config.names import TaskName
from grpo_stream.common.registry.rewards import BUILTIN_REWARDS
from grpo_stream.common.registry.tasks import TASKS, task_spec


class DatasetSection(Strict):
    source: FilePath = Field(None, description="task.name=gsm8k or ifeval: a directory with {split}.jsonl or "
                               "{split}.parquet, one such file, or a Hugging Face datasets name (openai/gsm8k; "
                               "downloads, where a network exists).")
    hub_config: str | None = Field("main", description="The datasets config of a hub source (GSM8K: main).")
    train_split: str = Field("train", min_length=1, description="Split the samplers draw prompts from.")
    test_split: str = Field("test", min_length=1, description="Split evaluation uses.")
    question_field: str = Field("question", min_length=1, description="Row field holding the problem.")
    answer_field: str = Field("answer", min_length=1, description="Row field holding the reference solution, "
                              "ending in '#### <number>'.")
    on_bad_row: Literal["skip", "error"] = Field("skip", description="A row without a usable question or answer: "
                                                 "'skip' (logged with its line) or 'error' (stop).")
    limit: int | None = Field(None, ge=1, description="Use at most this many rows per split (null: all).")


class TaskSection(Strict):
    name: TaskName = Field("arith", description="'arith': generated addition word problems, GSM8K "
                                            "answer format (`#### N`); 'gsm8k': math word problems from "
                                            "task.dataset; 'ifeval': google/IFEval's prompts from task.dataset, "
                                            "scored by lm-eval's instruction checks.")
    dataset: DatasetSection = Field(default_factory=DatasetSection, description="task.name=gsm8k: where the "
                                    "problems come from.")
    prompt_template: Literal["plain", "chat", "reasoning", "tools"] = Field(
        "plain", description="How every task renders a question (samplers, warm start, evaluation, injected "
        "questions; common/tasks/prompts.py). 'plain': BOS text + 'Q: <question> A:' (the tiny demo's; an instruct "
        "model whose BOS is a chat role token, SmolLM2's <|im_start|>, needs 'chat'); 'chat': the tokenizer's chat "
        "template with the question as the user turn, as the OpenAI endpoint renders the same messages; "
        "'reasoning': chat template with a system prompt asking for <reasoning>...</reasoning><answer>...</answer> "
        "(the Tunix GSM8K demo format); 'tools': chat template listing environment.name=gsm8k_tools's tools, asking "
        "for a final '#### N'. ifeval takes plain or chat; arith and arith_tools plain, chat or reasoning.")
    system_prompt: str | None = Field(None, max_length=8192, description="A chat-form prompt_template's system "
                                      "turn (chat: none when null; reasoning and tools: replaces their own). "
                                      "Refused with prompt_template=plain.")
    rewards: dict[str, float] = Field(
        default_factory=lambda: {"answer_correct": 1.0, "answer_format": 0.1}, min_length=1,
        description="Reward -> weight. Built-ins: answer_correct, answer_format (#### N), last_number (the last "
        "number a reply writes is the answer: chat-form prompts), reasoning_answer_format, "
        "ifeval_strict and ifeval_loose (task.name=ifeval: share of a prompt's instructions followed); "
        "or 'package.module:function' taking (completion_text, reference_answer) -> float. Default: "
        "{answer_correct: 1.0, answer_format: 0.1}; with task.name=ifeval {ifeval_strict: 1.0, ifeval_loose: 0.0}.")
    reward_timeout_s: float = Field(10.0, gt=0, le=600, description="Longest a reward may take on one completion. "
                                    "Rewards run in a worker process (the completion and its reference are anyone's "
                                    "input): one that overruns scores 0, is logged once per reward, and its worker "
                                    "is restarted.")
    reward_memory_mb: float | None = Field(2048.0, ge=64, le=1 << 20, description="Memory a reward's worker may "
                                           "allocate past its imports (its address space is capped there): a "
                                           "reward that allocates past it on some input scores 0, is logged once, "
                                           "and its worker is restarted, instead of the host's OOM killer choosing "
                                           "the sampler. null: no cap.")
    verifiers: VerifiersSection = Field(default_factory=VerifiersSection, description="task.name=verifiers: the "
                                        "environment and its arguments.")
    min_operand: int = Field(10, ge=0, le=10**6, description="Smallest operand of a problem.")
    max_operand: int = Field(99, ge=1, le=10**6, description="Largest operand of a problem.")
    heldout_fraction: float = Field(0.1, gt=0, lt=0.5,
                                    description="Share of operand pairs kept out of training for evaluation.")

    @model_validator(mode="before")
    @classmethod
    def _task_rewards(cls, data: Any) -> Any:
        """The task's own rewards when task.rewards is not given (the registry's default_rewards; IFEval's: the answer
        rewards score an IFEval reference, which has no '#### N', 0, and a run trained on answer_format's alone)."""
        named = isinstance(data, dict) and "rewards" not in data and isinstance(data.get("name"), str)
        spec = TASKS.get(data["name"]) if named else None
        if spec is not None and spec.default_rewards:
            return {**data, "rewards": dict(spec.default_rewards)}
        return data

    @model_validator(mode="after")
    def _range(self) -> "TaskSection":
        if self.max_operand <= self.min_operand:
            raise ValueError(f"task.max_operand={self.max_operand} must exceed task.min_operand={self.min_operand}")
        if self.system_prompt and self.prompt_template == "plain":
            raise ValueError("task.system_prompt needs a chat-form task.prompt_template (chat, reasoning or tools); "
                             "'plain' has no system turn")
        for name in self.rewards:  # a misspelt built-in failed only when a sampler built its rewards, after `up` began
            if ":" not in name and name not in BUILTIN_REWARDS:
                close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1)
                raise ValueError(f"{BUILTIN_REWARDS.field}.{name}: {BUILTIN_REWARDS.unknown(name)}"
                                 + (f" (did you mean {close[0]!r}?)" if close else ""))
        answer_rewards = {"answer_correct", "answer_format", "last_number", "reasoning_answer_format"}
        spec = task_spec(self.name)
        if not spec.scored_by_answers and all(r in answer_rewards for r, w in self.rewards.items() if w):
            raise ValueError(f"task.rewards={self.rewards} with task.name={self.name}: these rewards score a '#### N' "
                             "or last-number answer, and its references have none (every completion scores 0 or its "
                             f"format alone); use {dict(spec.default_rewards)}, or a reward of your own")
        if spec.own_rollouts and not self.verifiers.environment:
            raise ValueError(f"task.name={self.name} needs task.verifiers.environment (an environment id or module)")
        return self
