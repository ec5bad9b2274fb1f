"""`bench gpu` (the accelerator checks of issues 21 and 22) end to end at tiny shapes on CPU: CI has no GPU, so this
proves the script's every stage runs and reports what BENCHMARKS.md reads from it; the figures come from a GPU."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # the bench lane (-m bench): run it before a GPU run


def run(tmp_path, *args):
    out = tmp_path / f"{args[0]}.json"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.bench.gpu", *args, "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_trainer_part_times_the_step_and_compares_memory_with_the_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"trainer": {"per_device_bytes": {"total": 1 << 20}}}))
    doc = run(tmp_path, "trainer", "--plan-json", str(plan), "--set", "trainer.remat=save_dots")
    assert doc["backend"] == "cpu" and doc["loss_finite"] and doc["remat"] == "save_dots"
    assert len(doc["step_seconds"]) == 3 and doc["step_seconds_median"] > 0
    assert doc["model_flops_per_step"] > 0 and doc["tokens_per_step"] == doc["rows"] * 32
    assert doc["plan_cpu_estimate"]["total"] == 1 << 20
    xla = doc["xla_this_backend"]
    # the analysis after the run lowers the same two programs and finds them in the fresh compilation cache
    assert xla["cache_hits"] == 2 and xla["per_device_bytes"]["total"] > xla["per_device_bytes"]["parameters"] > 0


def test_sampler_part_times_every_engine_on_both_request_sets(tmp_path):
    doc = run(tmp_path, "sampler")
    assert doc["logits_agree"] and doc["torch_device"] == "cpu"
    assert set(doc["longtail"]["engines"]) == {"ours", "hf", "static"} and set(doc["fixed"]["engines"]) == {"ours", "hf"}
    for case in ("longtail", "fixed"):
        assert all(e["tokens_per_second"] > 0 for e in doc[case]["engines"].values())
        assert doc[case]["ratio_vs_hf"] > 0
    assert doc["longtail"]["ratio_vs_static"] > 0 and doc["longtail"]["engines"]["ours"]["programs_compiled"] > 0


def test_stages_past_the_deadline_are_reported_as_skipped(tmp_path):
    doc = run(tmp_path, "sampler", "--deadline-s", "0")
    assert all(e == {"skipped": "deadline"} for case in ("longtail", "fixed") for e in doc[case]["engines"].values())


def test_trainer_part_with_lora_trains_the_adapters_only(tmp_path):
    doc = run(tmp_path, "trainer", "--set", "model.lora.rank=2")
    assert doc["loss_finite"] and doc["lora"]["rank"] == 2 and len(doc["step_seconds"]) == 3
    assert 0 < doc["trained_parameters"] < 0.1 * doc["model_parameters"]
    # Adam's moments (and the float32 master copy when parameters are bfloat16) of the adapters alone
    assert doc["optimizer_bytes"] < 0.1 * doc["params_bytes"]
    assert doc["mfu"] is None and "skipped" in doc["xla_this_backend"]


def test_engine_part_times_whole_groups_when_the_slots_are_not(tmp_path):
    """10 slots and groups of 4: the sampler holds 2 groups (8 rows), the default load; it asked for 10 rows, which
    the engine part refuses (a load is whole groups), so it timed nothing."""
    doc = run(tmp_path, "engine", "--config", "configs/tiny_arith_smoke.yaml",
              "--set", "sampler.rows_in_flight=10", "--set", "generation.decode_slots=10")
    assert doc["rows"] == 8 and list(doc["loads"]) == ["8"] and doc["tokens_per_second"] > 0
