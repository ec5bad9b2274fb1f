"""`grpo-stream eval`: score a policy on a split with the sampler engine, write the figures as JSON.

The policy is the config's model: a Hugging Face directory (model.kind=hf,
e.g. a run's exported `RUN_DIR/model`), or the tiny model at its seeded
initialisation. Each problem is made by the run's rollout kind (single turn, an environment's episodes, a verifiers
environment's rollouts). Greedy pass@1 and mean reward by task.rewards (or the rubric) always; pass@k and maj@k when
eval.samples > 0; the task's own figures when it has them (`eval_metrics`: IFEval's four, under "task_metrics").
"""

from __future__ import annotations

import logging
import pathlib
import time

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.arguments import check_json_path
from grpo_stream.common.runtime.files import to_json, write_atomic

log = logging.getLogger("grpo_stream.eval")


def run_eval(cfg: RunConfig, split: str, limit: int | None, json_path: pathlib.Path | None) -> dict:
    if json_path:
        check_json_path(json_path)
    from grpo_stream.common.episodes.evaluation import evaluate_run  # noqa: PLC0415 - imports JAX
    from grpo_stream.common.engine import continuous  # noqa: PLC0415
    from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer  # noqa: PLC0415

    task, tokenizer = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tokenizer.vocab_size, seed=cfg.run.seed)
    engine = continuous.build(cfg, model, tokenizer)
    problems = task.split_problems(split, limit or cfg.eval.num_problems)
    log.info("evaluating %s on %d %s problems (greedy%s)", cfg.model.path or "the tiny model", len(problems), split,
             f" + {cfg.eval.samples} samples each" if cfg.eval.samples else "")
    result = evaluate_run(cfg, engine, model.params, task, tokenizer, problems).as_dict()
    doc = {"model": cfg.model.path or "tiny", "task": cfg.task.name, "split": split,
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), **result}
    if json_path:
        write_atomic(json_path, to_json(doc, indent=2) + "\n")  # whole, and strict JSON (a NaN figure as null)
    return doc
