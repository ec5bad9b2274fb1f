"""`grpo-stream plan` as a user runs it: a child process compiles the run's programs for fake CPU devices and the
report says, per device and category, whether the trainer and the sampler fit the config's hardware."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.memory import child_env, verdict

pytestmark = pytest.mark.e2e  # `grpo-stream plan` as a process, with its child
ROOT = pathlib.Path(__file__).resolve().parents[2]
# a tiny-model config large enough that the step's buffers dwarf the interpreter's own allocations
MEASURED = ["model.tiny.vocab_size=4096", "model.tiny.embed_dim=256", "model.tiny.num_layers=4",
            "model.tiny.hidden_dim=1024", "generation.max_prompt_tokens=64", "generation.max_new_tokens=64",
            "trainer.groups_per_step=8", "trainer.tokens_per_micro_batch=8192"]  # packed: one pass of all 64 rows


def plan(tmp_path: pathlib.Path, config: str, *overrides: str) -> tuple[int, str, dict | None]:
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.cli", "plan", "--config", config, "--json", str(out),
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.heavy  # 22 s; `plan` as a process stays in the default lane (test_a_cpu_run_gets_each_process_expected_peak...)
def test_tiny_run_on_two_devices_fits_and_reports_every_category(tmp_path):
    code, output, doc = plan(tmp_path, "configs/tiny_arith.yaml", "trainer.mesh.fsdp=2", "sampler.mesh.tp=2",
                             "hardware.trainer_memory_gib=2", "hardware.sampler_memory_gib=1", "hardware.gpus=2")
    assert code == 0, output
    # on two GPUs the samplers' tp=2 groups are the trainer's GPUs: shares of each from these figures, filling 90%
    shares = {p["name"]: p["share"] for p in doc["devices"]["processes"]}
    assert doc["devices"]["sharing"] == {"0": ["trainer", "sampler-0", "sampler-1"],
                                         "1": ["trainer", "sampler-0", "sampler-1"]}
    assert sum(shares.values()) == pytest.approx(0.9, abs=0.003) and shares["sampler-0"] == shares["sampler-1"]
    assert "on 2 GPU(s) (hardware.gpus)" in output
    assert doc["fits"] is True and "does not fit" not in output
    trainer, sampler = doc["trainer"], doc["sampler"]
    assert trainer["devices"] == 2 and sampler["devices"] == 2
    assert trainer["device_memory_bytes"] == 2 << 30 and sampler["device_memory_bytes"] == 1 << 30
    params = trainer["per_device_bytes"]["parameters"]
    # fsdp=2 holds half of the float32 parameters per device (within the dimensions fsdp does not divide)
    assert 0.45 * 434_944 * 4 <= params <= 0.6 * 434_944 * 4
    assert trainer["per_device_bytes"]["optimizer_state"] >= 2 * params  # Adam's two moments
    for role in (trainer, sampler):
        sizes = role["per_device_bytes"]
        assert sizes["total"] >= sum(v for k, v in sizes.items() if k not in ("total", "gradients", "batch",
                                                                                "updated_state",
                                                                                "activations_and_temporaries"))
    assert sampler["per_device_bytes"]["kv_cache"] > 0 and sampler["programs"]["decode_chunk"]["peak"] > 0
    # tp=2 divides the tiny model's 2 KV heads: each device holds half of the caches, as the engine lays them out
    # (the slot state's other arrays, a few percent here, stay whole); counted replicated, it was all of them
    arch = doc["architecture"]
    caches = 2 * arch["num_layers"] * arch["num_kv_heads"] * arch["head_dim"] * sampler["slots"] * 4
    assert sampler["per_device_bytes"]["kv_cache"] < 0.6 * caches * sampler["cache_tokens"]

    # the same programs against a device too small: no fit, fixes named by their fields
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", ["hardware.trainer_memory_gib=0.01"])
    small = verdict(cfg, "trainer", dict(trainer))
    assert small["fits"] is False
    assert any(f.startswith("trainer.remat=full") for f in small["fixes"])
    assert any(f.startswith("trainer.mesh.fsdp=") for f in small["fixes"])
    # packed (the default): the step compiled is a pass of a quarter of the 128 sequences' rows, and a smaller
    # token budget is a fix
    assert trainer["packing"] == {"rows": 32, "row_tokens": 42, "tokens_per_pass": 1344, "segments_per_row": 4}
    assert "packed passes of 32 rows x 42 tokens" in output
    assert any(f.startswith("trainer.tokens_per_micro_batch=672:") for f in small["fixes"])
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", ["hardware.trainer_chip=h100-80gb",
                                                          "hardware.sampler_memory_gib=0.001"])
    small = verdict(cfg, "sampler", dict(sampler))
    assert small["fits"] is False and small["device_memory_bytes"] == 2 ** 30 // 1000
    assert any(f.startswith("sampler.dtype=bfloat16") for f in small["fixes"])
    # the engine keeps its version while the next one arrives, whatever weights.background_fetch says: no fix
    assert sampler["per_device_bytes"]["fetch_buffer"] == sampler["per_device_bytes"]["parameters"]
    assert not any("background_fetch" in f for f in small["fixes"])


@pytest.mark.heavy  # a plan that compiles its programs (45 s); the arithmetic refusals stay in the default lane
def test_too_small_a_device_exits_1_and_names_fixes(tmp_path):
    code, output, doc = plan(tmp_path, "configs/tiny_arith.yaml", "hardware.trainer_memory_gib=0.05",
                             "hardware.sampler_memory_gib=1", "model.lora.rank=4")
    assert code == 1, output
    assert doc["fits"] is False and doc["trainer"]["fits"] is False and doc["sampler"]["fits"] is True
    assert "DOES NOT FIT" in output and "fix: trainer.remat=full" in output
    # the update's activations follow the packed passes' token budget, not the minibatch
    _, _, quarter = plan(tmp_path, "configs/tiny_arith.yaml", "hardware.trainer_memory_gib=0.05",
                         "hardware.sampler_memory_gib=1", "model.lora.rank=4", "trainer.tokens_per_micro_batch=336")
    activations = [d["trainer"]["per_device_bytes"]["activations_and_temporaries"] for d in (doc, quarter)]
    assert activations[1] < 0.5 * activations[0], activations
    # LoRA is planned as the trainer runs it: the optimizer holds the adapters' moments (and float32 copies) only,
    # the reference copy is the adapters'; a sampler keeps the frozen base beside the merged weights
    trainer, sampler = doc["trainer"], doc["sampler"]
    assert 0 < trainer["trained_parameters"] < 0.1 * trainer["parameters"]
    sizes = trainer["per_device_bytes"]
    assert sizes["optimizer_state"] < 0.1 * 2 * sizes["parameters"]  # Adam's two moments of the whole model: 2x
    assert sizes["reference_parameters"] < 0.1 * sizes["parameters"]
    assert sampler["per_device_bytes"]["lora_base"] == sampler["per_device_bytes"]["parameters"]
    assert sampler["programs"]["lora_merge"]["peak"] > 0
    assert "model.lora: rank 4 adapters" in output and doc["lora_note"].startswith("model.lora: rank 4")


# `plan` with its measuring child (~70 s, stop 76); the plan's arithmetic refusals stay in the default lane
@pytest.mark.heavy
def test_a_cpu_run_gets_each_process_expected_peak_from_what_the_child_measured(tmp_path):
    """Issue 58: hardware.trainer_chip=cpu adds each process's expected peak resident memory, its runtime and compile
    measured by the child itself; BENCHMARKS.md compares the SmolLM2 run's with `up`'s measured peaks."""
    code, output, doc = plan(tmp_path, "configs/tiny_arith.yaml", "hardware.trainer_chip=cpu")
    assert code == 0, output
    for role in ("trainer", "sampler"):
        estimate = doc[role]["host_peak"]
        assert doc[role]["host_peak_bytes"] == estimate["total"] == sum(estimate["parts"].values())
        assert estimate["parts"]["devices"] == doc[role]["per_device_bytes"]["total"]
        # a Python process with JAX and the services imported holds well over 100 MB before any weights
        assert estimate["parts"]["runtime"] > 100 << 20 and estimate["parts"]["compiled_programs"] > 0
        assert f"the {role} process's expected peak resident memory" in output
    assert doc["trainer"]["host_peak"]["parts"]["evaluation_engine"] > 0
    assert doc["cpu_host"]["total_bytes"] == (doc["trainer"]["host_peak_bytes"]
                                              + 2 * doc["sampler"]["host_peak_bytes"])  # tiny_arith: 2 samplers
    assert doc["fits"] and "trainer x 1 + sampler x 2 expected peaks" in output


def test_no_hardware_is_a_config_error_naming_the_field(tmp_path):
    code, output, doc = plan(tmp_path, "configs/tiny_arith.yaml")
    assert code == 2 and doc is None
    assert "hardware.trainer_chip" in output


@pytest.mark.heavy  # a measured update step (about a minute); the plan's arithmetic tests stay in the default lane
def test_plan_total_agrees_with_a_measured_step(tmp_path):
    """The trainer total against one real update step on CPU: its input arrays' bytes plus the resident-memory
    growth while it runs (outputs and temporaries), within 25%."""
    # the step alone: the held-out evaluation's engine, which the plan counts too (plan/evaluation.py), is not measured
    code, output, doc = plan(tmp_path, "configs/tiny_arith.yaml", *MEASURED, "hardware.trainer_memory_gib=64",
                             "hardware.sampler_memory_gib=64", "trainer.eval_before=false",
                             "trainer.eval_after=false", "eval.every_steps=0")
    assert code == 0, output
    cfg = load_config(ROOT / "configs/tiny_arith.yaml", MEASURED)
    proc = subprocess.run([sys.executable, str(ROOT / "tests/e2e/plan_step_measure.py")],
                          input=cfg.model_dump_json(), capture_output=True, text=True, timeout=600,
                          env={**child_env(1), "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    measured = json.loads(proc.stdout)
    held = measured["inputs_bytes"] + measured["step_growth_bytes"]
    planned = doc["trainer"]["per_device_bytes"]["total"]
    assert planned > 500 << 20  # large enough to measure
    assert abs(held - planned) <= 0.25 * planned, (held, planned, measured)


@pytest.mark.slow
@pytest.mark.heavy  # 5-7 minutes of compiling each on 2 cores; the tiny config's plan tests stay in the default lane
@pytest.mark.parametrize("preset", ["qwen2.5_1.5b_gsm8k_gpu.yaml", "llama3.1_8b_gsm8k_tpu_host.yaml"])
def test_shipped_presets_fit_their_declared_hardware(tmp_path, preset):
    code, output, doc = plan(tmp_path, f"configs/{preset}")
    assert code == 0, output
    assert doc["fits"] and doc["trainer"]["fits"] and doc["sampler"]["fits"]
    assert doc["trainer"]["parameters"] > 1e9
    # full fine-tuning on a 16 GB chip: no fit, and LoRA is among the fixes (Adam's float32 state is 12 bytes per
    # parameter, a third of the total or more)
    cfg = load_config(ROOT / "configs" / preset, ["hardware.trainer_memory_gib=16"])
    small = verdict(cfg, "trainer", dict(doc["trainer"]))
    assert small["fits"] is False and any(f.startswith("model.lora.rank=16") for f in small["fixes"])


@pytest.mark.slow
@pytest.mark.heavy
def test_the_70b_preset_fits_its_split_slices(tmp_path):
    """The 70B preset's plan (its update step compiles for about 4 minutes on 2 cores: 80 layers on 32 fake
    devices): the trainer fits a v5p chip with FSDP over 32 (weights gathered a layer at a time inside each
    micro-batch pass, activations sharded over the batch), its held-out evaluation's KV cache whole on each chip
    included; a sampler fits 8 chips with the next version's copy beside the installed one and its layout."""
    code, output, doc = plan(tmp_path, "configs/llama3.1_70b_gsm8k_split_slices.yaml")
    assert code == 0, output
    assert doc["trainer"]["parameters"] > 70e9 and doc["trainer"]["devices"] == 32 and doc["sampler"]["devices"] == 8
    trainer = doc["trainer"]["per_device_bytes"]
    # the step's temporaries stay below the weights' share of the chip's memory, not the whole model's gathers
    assert trainer["activations_and_temporaries"] < 40 << 30, trainer
    # eval.batch_size=128 rows of 768 positions: 80 layers x 8 KV heads x 128 x 2 (keys, values) x 2 bytes each
    evaluation = doc["trainer"]["evaluation"]
    assert evaluation["rows"] == 128 and evaluation["kv_cache"] >= 128 * 768 * 80 * 8 * 128 * 2 * 2, evaluation
    # the version arriving is counted whatever weights.background_fetch says (false too): the engine decodes on
    # its own thread with the installed version and its layout until it takes the new one
    sampler = doc["sampler"]["per_device_bytes"]
    assert sampler["fetch_buffer"] == sampler["parameters"] and doc["sampler"]["fits"] is True, sampler


def test_an_unknown_checkpoint_without_config_json_names_model_path(tmp_path):
    code, output, doc = plan(tmp_path, "configs/qwen2.5_1.5b_gsm8k_gpu.yaml", f"model.path={tmp_path}/my-model")
    assert code == 2 and doc is None
    assert "model.path" in output and "config.json" in output
