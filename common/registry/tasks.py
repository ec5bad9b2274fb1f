"""Every task by its config name (task.name). Adding one: a module with `build(cfg, hf_tokenizer) -> (task,
tokenizer)` (the task per common/tasks/base.py Task; the tokenizer is the checkpoint's when given, else one trained
on the task's own text) and a line here."""

from __future__ import annotations

import dataclasses

from grpo_stream.common.registry.base import Registry


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    module: str              # defines build(cfg, hf_tokenizer)
    dataset: bool = False    # reads task.dataset (its source must be given)
    warmstart: bool = False  # has the supervised warm start's demonstrations (tiny model only)
    # runs its own rollouts against the samplers' OpenAI-compatible endpoint (common/episodes/verifiers.py)
    own_rollouts: bool = False
    # its task.rewards when the config names none (empty: the answer rewards, answer_correct and answer_format)
    default_rewards: tuple[tuple[str, float], ...] = ()
    # its references end in an answer the answer rewards read ('#### N', a last number); False: they score it 0
    scored_by_answers: bool = True


TASKS: Registry[TaskSpec] = Registry("task.name", "task", {
    # generated addition word problems (the CPU demo)
    "arith": TaskSpec("grpo_stream.common.tasks.arith", warmstart=True),
    # the same problems answered with a calculator tool (the multi-turn CPU demo; environment.name=arith_tools)
    "arith_tools": TaskSpec("grpo_stream.common.tasks.arith_tools", warmstart=True),
    # math word problems from a dataset (task.dataset)
    "gsm8k": TaskSpec("grpo_stream.common.tasks.gsm8k", dataset=True),
    # instruction-following prompts of google/IFEval, scored by lm-eval's checks (task.dataset; the `ifeval` extra)
    "ifeval": TaskSpec("grpo_stream.common.tasks.ifeval", dataset=True, scored_by_answers=False,
                       default_rewards=(("ifeval_strict", 1.0), ("ifeval_loose", 0.0))),
    # a `verifiers` environment (task.verifiers): its dataset, multi-turn rollouts and rubric (the `verifiers` extra)
    "verifiers": TaskSpec("grpo_stream.common.tasks.verifiers_task", own_rollouts=True),
})
task_spec = TASKS.lookup
