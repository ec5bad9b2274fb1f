"""A distillation teacher for tests and measurements, made in seconds: the smoke demo's tiny model, wider and deeper,
warm-started on demonstrations that never drop the carry (so it is stronger than a student warm-started as the demo
is), exported as a Hugging Face directory with the tiny model's own tokenizer (the one every student of the arith
task trains alike). Run as a script: `python -m tests.e2e.distill_teacher DIR [warm start steps]`."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEACHER = ["model.tiny.num_layers=2", "model.tiny.embed_dim=64", "model.tiny.hidden_dim=192", "model.tiny.num_heads=4",
           "model.tiny.num_kv_heads=2", "model.tiny.head_dim=16", "warmstart.carry_drop_prob=0",
           "warmstart.batch_size=32", "warmstart.learning_rate=0.003"]


def make_teacher(directory: pathlib.Path, steps: int = 150) -> pathlib.Path:
    from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.model.hf_checkpoint import export_hf
    from grpo_stream.trainer_service.learning.warmstart import warm_start

    cfg = load_config(ROOT / "configs/tiny_arith_smoke.yaml", [*TEACHER, f"warmstart.steps={steps}"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tokenizer.vocab_size, seed=1)
    params, report = warm_start(model, model.params, task, tokenizer, cfg)
    tokenizer.save(directory)
    export_hf(directory, model.arch, model.to_named_numpy(params), eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    print(f"teacher: {model.num_params()} parameters, warm start loss {report['final_loss']:.3f}", file=sys.stderr)
    return directory


if __name__ == "__main__":
    make_teacher(pathlib.Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 150)
