"""`grpo-stream plan` counts the distillation teacher: its parameters per device (resident beside the policy, no
optimizer state or gradients of its own), its forward program over a minibatch's passes, and the FLOPs of its
forwards per step; all grow with the teacher's size. Compiled in-process on one CPU device (the plan's child runs
the same function on fake devices); only the teacher's config.json is read, never weights."""

import pathlib

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.hf_checkpoint import write_hf_config
from grpo_stream.plan.memory import render, run_plan, verdict
from grpo_stream.plan.programs import architecture, trainer_programs

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["model.tiny.num_layers=1", "model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.head_dim=16", "trainer.groups_per_step=4",
         "generation.num_generations=4", "hardware.trainer_memory_gib=1", "hardware.sampler_memory_gib=1"]


def teacher_dir(path: pathlib.Path, layers: int, width: int, vocab: int = 160) -> pathlib.Path:
    arch = Architecture(family="qwen2", vocab_size=vocab, num_layers=layers, embed_dim=width, hidden_dim=2 * width,
                        num_heads=4, num_kv_heads=2, head_dim=width // 4, norm_eps=1e-6, rope_theta=1e6,
                        tied_embeddings=False)
    path.mkdir(parents=True)
    write_hf_config(path, arch)
    return path


def test_plan_counts_the_teacher_and_it_grows_with_its_size(tmp_path):
    plain = load_config(ROOT / "configs/tiny_arith.yaml", SMALL)
    without = trainer_programs(plain, architecture(plain))
    assert without["per_device_bytes"]["teacher_parameters"] == 0 and "teacher" not in without
    reports = []
    for layers, width in ((1, 64), (4, 128)):
        cfg = load_config(ROOT / "configs/tiny_arith.yaml",
                          [*SMALL, f"distill.teacher={teacher_dir(tmp_path / f't{layers}', layers, width)}"])
        reports.append(trainer_programs(cfg, architecture(cfg)))
    small, large = reports
    for r in reports:
        sizes, teacher = r["per_device_bytes"], r["teacher"]
        assert sizes["teacher_parameters"] == teacher["parameters_bytes"] == 4 * teacher["parameters"]  # float32
        assert sizes["optimizer_state"] == without["per_device_bytes"]["optimizer_state"]  # frozen: no state
        assert sizes["total"] >= without["per_device_bytes"]["total"] + sizes["teacher_parameters"]
        assert r["programs"]["teacher_logprobs"]["peak"] > sizes["teacher_parameters"]
        # XLA's count of one pass, times the passes of every minibatch of a step
        assert teacher["forward_flops_per_step"] >= teacher["flops_per_pass"] > 0
    assert large["teacher"]["parameters"] > 10 * small["teacher"]["parameters"]
    assert large["per_device_bytes"]["teacher_parameters"] > 10 * small["per_device_bytes"]["teacher_parameters"]
    assert large["per_device_bytes"]["total"] > small["per_device_bytes"]["total"]
    assert large["teacher"]["forward_flops_per_step"] > 10 * small["teacher"]["forward_flops_per_step"]
    doc = {"architecture": {"family": "qwen3"}, "trainer": verdict(cfg, "trainer", {**large, "parameters": 1}),
           "fits": True}
    assert "distillation teacher: " in render(cfg, doc) and "TFLOP per step" in render(cfg, doc)


def test_a_teacher_plan_cannot_size_or_the_trainer_would_refuse_fails_before_compiling(tmp_path):
    """Named as model.path is, before the child compiles anything: a teacher without config.json (the child's
    traceback, under its sampler compile, was all it said), and one whose embedding has fewer rows than the
    student's 160 (the trainer refuses it at start; the plan passed it)."""
    for teacher, said in ((tmp_path / "none", "config.json"), (teacher_dir(tmp_path / "small", 1, 64, 120), "rows")):
        cfg = load_config(ROOT / "configs/tiny_arith.yaml", [*SMALL, f"distill.teacher={teacher}"])
        with pytest.raises(ValueError, match=f"distill.teacher={teacher}.*{said}"):
            run_plan(cfg, None)
