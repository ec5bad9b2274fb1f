"""`grpo-stream bench all --quick` runs every benchmark once end to end (a check that each works, not a
speed test): one JSON file each, one markdown row each, targets evaluated."""

import json
import os
import subprocess
import sys

import pytest

from grpo_stream.bench.startup import check_cache
from tests.e2e.test_up import ROOT

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.bench]  # the bench lane (-m bench)


BENCHMARKS = ("transport", "pipeline", "sampler", "async", "weights", "prompts", "startup", "trainer", "multiturn",
              "rollouts")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One `bench all --quick` run for every test here: (its JSON folder, its markdown table, each benchmark's JSON)."""
    tmp_path = tmp_path_factory.mktemp("bench-all")
    out, table = tmp_path / "bench", tmp_path / "results.md"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream", "bench", "all", "--quick", "--json", str(out),
                           "--table", str(table)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, table, {name: json.loads((out / f"{name}-quick.json").read_text()) for name in BENCHMARKS}


def test_every_benchmark_wrote_its_json_with_its_targets(quick):
    for name, result in quick[2].items():
        assert result["benchmark"] == name and result["quick"] is True and "error" not in result
        assert result["targets"] and all(isinstance(t["met"], bool) for t in result["targets"].values())



def test_transport_every_encoding_moved_the_same_groups(quick):
    transport = quick[2]["transport"]
    assert transport["groups"] == 16 and transport["tokens_per_completion"] == 512
    assert all(transport["groups_per_second"][k] > 0 for k in ("ours", "json", "pickle", "raw_redis"))


def test_pipeline_prefetch_shares_add_up_on_and_off(quick):
    pipeline = quick[2]["pipeline"]
    for run, ahead in ((pipeline, pipeline["steps_counted"]), (pipeline["prefetch_off"], 0)):  # prefetch on, off
        assert 0 < run["overhead_share"] < 1 and run["steps_counted"] > 0 and run["plans_prepared_ahead"] == ahead
        assert sum(run["main_thread_share"].values()) == pytest.approx(1.0, abs=0.02)
        assert run["overhead_share"] == pytest.approx(1 - run["main_thread_share"]["compute"], abs=1e-3)
    assert pipeline["prefetch_off"]["main_thread_share"]["plan_wait"] >= sum(
        pipeline["prefetch_off"]["prepare_share"].values()) - 1e-3  # made on the main thread, inside the wait
    assert sum(pipeline["prefetch_off"]["overlapped_share"].values()) == 0 < sum(pipeline["overlapped_share"].values())
    assert pipeline["compute_slowdown"] == pytest.approx(
        pipeline["compute_seconds_per_step"]["on"] / pipeline["compute_seconds_per_step"]["off"], rel=1e-2)
    assert pipeline["steps_counted"] + pipeline["prefetch_off"]["steps_counted"] < pipeline["steps_timed"]


def test_sampler_rates_and_ratios_agree_with_their_own_figures(quick):
    sampler = quick[2]["sampler"]
    assert sampler["logits_max_rel_diff"] < 1e-3
    for case in ("longtail", "fixed"):
        engines = sampler[case]["engines"]
        rate = {k: v["tokens_per_second"] for k, v in engines.items() if "tokens_per_second" in v}
        assert rate["ours"] > 0 and rate["hf"] > 0 and engines["ours"]["cores_busy"] > 0
        assert sampler[case]["ratio_vs_hf"] == pytest.approx(rate["ours"] / rate["hf"], rel=0.01)
        # vLLM on the same request sets, next to the JAX engine (where the vLLM environment exists)
        if "vllm" in rate:
            assert sampler[case]["ratio_vs_vllm"] == pytest.approx(rate["ours"] / rate["vllm"], rel=0.01)
        else:
            assert "missing" in engines["vllm"] and os.environ.get("GRPO_STREAM_REQUIRE_VLLM") != "1", engines
    longtail = sampler["longtail"]
    # HF batches statically: both cases are one timed run set, each rated by its own useful tokens
    hf_rates = {case: sampler[case]["engines"]["hf"]["tokens_per_second"] for case in ("longtail", "fixed")}
    assert hf_rates["longtail"] / hf_rates["fixed"] == pytest.approx(
        longtail["useful_tokens"] / sampler["fixed"]["useful_tokens"], rel=0.01)
    assert longtail["ratio_vs_static"] > 0 and longtail["rows_at_limit"] >= 1
    assert longtail["budget_median"] < longtail["budget_max"] == sampler["max_new_tokens"]
    assert 0 < longtail["engines"]["ours"]["slot_use"] <= 1 and longtail["engines"]["ours"]["programs_compiled"] > 0


def test_async_synchronous_mode_is_synchronous_and_every_run_generated(quick):
    asynchronous = quick[2]["async"]
    # synchronous mode really is synchronous: every group trained at staleness 0, none dropped
    assert all(r["staleness_max"] == 0 and r["groups_dropped_stale"] == 0 for r in asynchronous["runs"]["sync"])
    assert asynchronous["async_over_sync"] > 0 and asynchronous["async_over_sync_total"] > 0
    assert 0.5 <= asynchronous["async_over_sync_bound"] <= 1 and 0 < asynchronous["generation_share_sync"] < 1
    assert all(r["steady_seconds_per_step"] > 0 for rs in asynchronous["runs"].values() for r in rs)
    assert all(r["groups_generated"] >= 6 * 16 and 0 <= r["generation_wasted_fraction"] < 1
               for rs in asynchronous["runs"].values() for r in rs)


def test_weights_every_case_moved_the_whole_model(quick):
    weights = quick[2]["weights"]
    # every case moved the same model's bytes (bf16 half of f32) into another process, and the stall phase
    # really published while stepping: the peer installed the last version
    cases = {(c["transport"], c["data_plane"], c["model_dtype"], c["wire_dtype"], c["lora_rank"]): c
             for c in weights["cases"]}
    assert len(cases) == 8 and ("checkpoint", None, "float32", "float32", None) in cases
    f32_bytes = weights["params"] * 4
    for plane in ("tcp", "grpc"):
        assert cases[("grpc", plane, "float32", "float32", None)]["bytes"] == f32_bytes
        assert cases[("grpc", plane, "bfloat16", "bfloat16", None)]["bytes"] * 2 == f32_bytes
        assert cases[("grpc", plane, "float32", "bfloat16", None)]["bytes"] * 2 == f32_bytes
    # LoRA: the first install brings the base (and adapters), every later one the adapters alone
    first, *later = cases[("grpc", "tcp", "float32", "float32", 16)]["sampler_fetch_bytes"]
    assert first > f32_bytes and later and all(n < 0.05 * f32_bytes for n in later)
    assert weights["lora_version_fraction"] == round(max(later) / f32_bytes, 4)
    assert all(c["publish_to_installed_s"] > 0 for c in cases.values())
    assert all(weights[f"fraction_of_raw_{k}"] > 0 for k in ("f32", "bf16", "float32_as_bfloat16",
                                                            "grpc_stream_float32", "grpc_stream_bfloat16"))
    assert weights["stall"]["versions_installed"][-1] == 1 and weights["stall"]["step_s"] > 0
    # multi-source: the whole model reached the sampler from 2 trainer processes, as from 1
    multi = weights["multi_source"]
    assert multi["single_process"]["bytes"] == multi["two_processes"]["bytes"] == f32_bytes
    assert weights["multi_source_over_single"] == round(multi["two_processes"]["mb_per_s"]
                                                        / multi["single_process"]["mb_per_s"], 3) > 0


def test_prompts_every_prompt_was_answered_once(quick):
    prompts = quick[2]["prompts"]
    # every prompt submitted was answered once and followed to its result, through a real ingest process
    assert prompts["submits"] > 0 and prompts["answered"] == prompts["submits"] and prompts["errors"] == 0
    assert prompts["submit_p50_ms"] > 0 and prompts["check_p50_ms"] > 0


def test_startup_the_warm_run_loaded_the_cold_runs_programs(quick):
    startup = quick[2]["startup"]
    # the cold run compiled and wrote every program, the warm run on its directory loaded them and compiled again
    # none (it may reach shapes the cold run did not): bench startup's own check, on the figures it wrote
    (cold,) = startup["runs"]["cold"]
    assert cold["written"] == cold["entries"] > 0
    check_cache(startup["runs"])
    assert startup["cold_seconds"] > 0 and startup["warm_seconds"] > 0


def test_rollouts_every_arm_made_the_same_tokens(quick):
    rollouts = quick[2]["rollouts"]
    single = rollouts["single_turn"]
    # every arm made the same useful tokens (every row its whole budget) and the stream acknowledged every group
    assert all(r["tokens"] == single["useful_tokens"] for runs in single["runs"].values() for r in runs)
    assert set(single["runs"]) == {"all_at_once", "stream", "batch_loop", "updates_in_flight", "updates_drain"}
    assert all(r["versions_installed"] >= 1 for arm in ("updates_in_flight", "updates_drain")
               for r in single["runs"][arm])
    assert rollouts["stream_over_all_at_once"] == pytest.approx(
        single["tokens_per_second"]["stream"] / single["tokens_per_second"]["all_at_once"], rel=0.01)
    multi = rollouts["multiturn"]
    assert len({r["tokens"] for runs in multi["runs"].values() for r in runs}) == 1  # the same episodes, either tool
    assert 0 <= multi["engine_idle_share"] < 1 and multi["tool_latency_s"] == 0.1


def test_evaluation_every_due_step_evaluated_or_skipped(quick):
    # evaluation during the run: none without it; with it, every due step of 12 (10) evaluated or skipped, no error
    evaluation = json.loads((quick[0] / "evaluation-quick.json").read_text())
    assert "error" not in evaluation and evaluation["off"]["evaluated_steps"] == [[0]]
    for setting in ("on", "held"):
        (steps,), (skipped,) = evaluation[setting]["evaluated_steps"], evaluation[setting]["skipped"]
        assert steps[0] == 0 and set(steps[1:]) | set(skipped) == {10} and evaluation[setting]["errors"] == 0
    assert evaluation["held_over_off"] > 0 and evaluation["targets"]["held_over_off"]["target"] == "<= 1.05"


def test_the_table_has_one_quick_row_per_benchmark(quick):
    rows = [line for line in quick[1].read_text().splitlines() if line.startswith("| 20")]
    assert [row.split(" | ")[2] for row in rows] == ["transport", "pipeline", "sampler", "async", "weights", "prompts",
                                                     "startup", "trainer", "multiturn", "rollouts", "evaluation"]
    assert all(" | quick | " in row for row in rows)
