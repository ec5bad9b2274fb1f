"""`grpo-stream plan` counts the trainer's held-out evaluation on the trainer's devices: the evaluation engine (a JAX
engine on the policy, whatever sampler.engine is) holds the weights in decode layout and a KV cache for the
evaluation's rows, and during RL (eval.every_steps) copies of the weights evaluated, beside the update steps.
Before, the plan left all of it out, so a config it passed could run out of device memory at eval_before. Compiled
in-process on one CPU device, as tests/unit/test_plan_teacher.py."""

import pathlib

from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.memory import verdict
from grpo_stream.plan.programs import architecture, trainer_programs

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["model.tiny.num_layers=1", "model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.head_dim=16", "trainer.groups_per_step=4",
         "generation.num_generations=4", "generation.max_new_tokens=200", "eval.batch_size=512", "eval.samples=0",
         "generation.decode_slots=512", "hardware.trainer_memory_gib=1", "hardware.sampler_memory_gib=1"]
QUIET = ["trainer.eval_before=false", "trainer.eval_after=false", "eval.every_steps=0", "weights.verify_prompts=0"]


def plan(*overrides: str) -> dict:
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", [*SMALL, *overrides])
    return trainer_programs(cfg, architecture(cfg))


def test_the_evaluation_engine_is_counted_on_the_trainer_devices():
    quiet = plan(*QUIET)
    assert quiet["per_device_bytes"]["evaluation"] == 0 and "evaluation" not in quiet
    before = plan(*QUIET[1:])  # eval_before only: between the steps, not beside them
    sizes, report = before["per_device_bytes"], before["evaluation"]
    # keys and values of 1 layer x 1 KV head x 16 dims, float32, for the 512 rows at the engine's whole window
    window = 24 + 200  # generation.max_prompt_tokens + max_new_tokens, as the engine's cache holds them (or more)
    assert report["slots"] == 512 and report["kv_cache"] >= 2 * 1 * 16 * 4 * 512 * window
    assert report["decode_weights"] >= quiet["per_device_bytes"]["parameters"] and report["weight_copies"] == 0
    assert sizes["evaluation"] == report["decode_weights"] + report["kv_cache"] > quiet["per_device_bytes"]["total"]
    assert sizes["total"] >= sizes["evaluation"] + sizes["parameters"] + sizes["optimizer_state"]
    assert before["peak_program"] == "evaluation"
    during = plan("trainer.eval_before=false", "trainer.eval_after=false", "eval.every_steps=2")
    copies = during["evaluation"]["weight_copies"]
    assert copies == 2 * quiet["per_device_bytes"]["parameters"]  # the version evaluated and the one waiting
    # beside the update steps: their peak and the evaluation together
    assert during["per_device_bytes"]["total"] == quiet["per_device_bytes"]["total"] + sizes["evaluation"] + copies


def test_a_trainer_that_does_not_fit_for_its_evaluation_names_the_eval_batch():
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", [*SMALL, *QUIET[1:], "hardware.trainer_memory_gib=0.015"])
    report = verdict(cfg, "trainer", trainer_programs(cfg, architecture(cfg)))
    assert report["fits"] is False
    assert any(f.startswith("eval.batch_size=256") for f in report["fixes"]), report["fixes"]
    quiet = load_config(ROOT / "configs/tiny_arith.yaml", [*SMALL, *QUIET, "hardware.trainer_memory_gib=0.015"])
    assert verdict(quiet, "trainer", trainer_programs(quiet, architecture(quiet)))["fits"]  # the evaluation's doing
