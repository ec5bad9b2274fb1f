"""What scripts/gpu-check.sh computes from a run's files (grpo_stream/gpu_check/figures.py) and the GSM8K-shaped
prompts it falls back on (grpo_stream/gpu_check/model.py), against hand-computed values."""

import json

import jax

from grpo_stream.bench.async_vs_sync import mode_overrides
from grpo_stream.common.tasks.gsm8k import load_problems
from grpo_stream.gpu_check.engine import engine_command
from grpo_stream.gpu_check.figures import comparison, memory_figures, missing_figures, run_figures, sampler_figures
from grpo_stream.gpu_check.model import gsm8k_source, write_gsm8k_shaped

SAMPLER = {"groups": 8, "tokens_generated": 1200, "generate_seconds": 4.0, "sampling_seconds": 10.0,
           "versions": [0, 1, 2], "fetch_seconds": [5.0, 0.5, 0.25], "fetch_bytes": [10**9] * 3,
           "publish_to_install_seconds": [30.0, 1.0, 2.0], "device_memory": {"peak_bytes_in_use": 300,
                                                                             "bytes_limit": 1000}}


def test_sampler_rates_and_hand_offs_leave_out_the_first_version():
    s = sampler_figures(SAMPLER)
    assert (s["tokens_per_second_generating"], s["tokens_per_second"]) == (300.0, 120.0)
    # version 0 waited for the sampler's own start (30 s, 5 s): not a hand-off
    assert s["per_version"] == [{"version": 1, "publish_to_install_s": 1.0, "fetch_s": 0.5, "gb_per_s": 2.0},
                                {"version": 2, "publish_to_install_s": 2.0, "fetch_s": 0.25, "gb_per_s": 4.0}]
    assert (s["publish_to_install_seconds_median"], s["fetch_gb_per_s_median"], s["fetch_gb_per_s_min"]) == (1.5, 3.0,
                                                                                                           2.0)


def test_peaks_against_the_plan_per_process_or_together_in_one():
    plan = {"trainer": {"per_device_bytes": {"total": 1000}}, "sampler": {"per_device_bytes": {"total": 500}}}
    summary = {"device_memory": {"peak_bytes_in_use": 800}}
    samplers = {"sampler-0": sampler_figures(SAMPLER)}
    apart = memory_figures(summary, samplers, plan, colocated=False)
    assert apart["trainer_peak_over_plan"] == 0.8 and apart["samplers"]["sampler-0"]["peak_over_plan"] == 0.6
    assert memory_figures(summary, samplers, plan, colocated=True)["peak_over_plan"] == round(800 / 1500, 3)
    assert memory_figures({"device_memory": None}, samplers, None, colocated=False)["trainer_peak_over_plan"] is None


def test_a_run_directory_becomes_figures(tmp_path):
    rows = [{"step": k, "time": 100.0 + 2 * k, "train/staleness_mean": 0.0, "train/staleness_max": 0,
             "train/compute_seconds": 1.0, "train/wait_seconds": 0.5, "train/step_seconds": 2.0} for k in range(1, 7)]
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sampler-0.json").write_text(json.dumps(SAMPLER))
    (tmp_path / "summary.json").write_text(json.dumps({"logprob_agreement_lag0": {"tokens": 5, "mean_abs": 0.01},
                                                       "weight_transport": "grpc", "rl_seconds": 12.0}))
    run = run_figures(tmp_path, 6)
    assert (run["steps"], run["steady_seconds_per_step"], run["steps_per_second"]) == (6, 2.0, 0.5)
    assert (run["trainer_compute_share"], run["trainer_wait_share"], run["trainer_busy_seconds"]) == (0.5, 0.25, 1.5)
    assert run["sampler_tokens_per_second"] == 120.0 and run["weights"]["publish_to_install_seconds_median"] == 1.5
    # sync 2.0 s a step of which the trainer's own work is 1.5: at best max(1.5, 0.5) / 2.0
    assert comparison({"steady_seconds_per_step": 1.6}, run, None) == {
        "async_over_sync": 0.8, "async_over_sync_bound": 0.75, "generation_share_sync": 0.25}
    phases = {p: {"status": "ok", "figures": run} for p in ("demo", "async", "sync", "colocated")}
    phases["demo"]["learning"] = {"gain_points": 12.0}
    phases.update(plan={"trainer_bytes": 1, "sampler_bytes": 1}, comparison={"async_over_sync": 1,
                                                                            "async_over_sync_bound": 1})
    engine = ("engine_tokens_per_second", "sampler_over_engine_async", "sampler_over_engine_sync",
              "sampler_over_engine_sync_same_rows")
    assert missing_figures(phases, device_memory=False) == [f"comparison.{k}" for k in engine]  # no engine phase
    phases["comparison"].update(dict.fromkeys(engine, 1.0))
    assert missing_figures(phases, device_memory=False) == []
    # on a GPU the peaks must be there too: the trainer's is missing here (the sampler's is not)
    assert missing_figures(phases, device_memory=True) == [f"{p}.memory.trainer" for p in ("demo", "async", "sync",
                                                                                          "colocated")]


def test_the_samplers_are_set_against_their_engine_alone_full_and_at_the_admitted_rows():
    """Issue 55's figure: the samplers' tokens/s while generating over the engine alone, kept full (256 rows) and, for
    the synchronous run, at the 32 rows its admission allows."""
    engine = {"rows": 256, "tokens_per_second": 1000.0, "sync_admitted_rows": 32,
              "loads": {"256": {"tokens_per_second": 1000.0}, "32": {"tokens_per_second": 400.0}}}
    fast = sampler_figures({**SAMPLER, "engine_rows_decoding_mean": 30.0})  # 300 tokens/s while generating
    slow = sampler_figures({**SAMPLER, "generate_seconds": 12.0, "engine_rows_decoding_mean": 10.0})  # 100
    runs = {"async": {"samplers": {"sampler-0": fast, "sampler-1": slow}}, "sync": {"samplers": {"sampler-0": fast}}}
    assert comparison(runs["async"], runs["sync"], None, engine) == {
        "skipped": "a run has too few steps", "engine_rows": 256, "engine_tokens_per_second": 1000.0,
        "sync_admitted_rows": 32, "engine_tokens_per_second_sync_admitted_rows": 400.0,
        "sampler_over_engine_async": 0.2, "sampler_rows_decoding_mean_async": 20.0,  # each sampler has its engine
        "sampler_over_engine_sync": 0.3, "sampler_rows_decoding_mean_sync": 30.0,
        "sampler_over_engine_sync_same_rows": 0.75}
    # no engine phase (skipped, stopped before a figure): nothing to set them against
    assert comparison(runs["async"], runs["sync"], None, {}) == {
        "skipped": "a run has too few steps"}


def test_the_engine_phase_holds_the_rows_the_synchronous_run_may_hold(tmp_path):
    """One step's groups at max_staleness 0 (8 groups of 4 rows), against the 256 the sampler keeps in flight; when
    admission allows all of them, one load."""
    args = ["--config", "configs/qwen2.5_1.5b_gsm8k_gpu.yaml", "trainer.groups_per_step=8", "buffer.max_groups=16"]
    cmd, held = engine_command(args, mode_overrides("sync", 8, 1), tmp_path / "cache", tmp_path / "engine.json", 75.4)
    assert held == 32 and cmd[1:4] == ["-m", "grpo_stream.bench.gpu", "engine"]
    # the admitted rows first: a phase stopped at its cap keeps issue 55's figure
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--rows"] == ["32", "256"]
    assert cmd[cmd.index("--deadline-s") + 1] == "75"  # it starts no load past its phase's cap
    assert ["--set", "trainer.groups_per_step=8"] == cmd[cmd.index("trainer.groups_per_step=8") - 1:][:2]
    assert f"runtime.compilation_cache_dir={tmp_path / 'cache'}" in cmd
    cmd, held = engine_command([*args, "sampler.rows_in_flight=16", "generation.decode_slots=16"],
                               mode_overrides("sync", 8, 1), tmp_path / "cache", tmp_path / "engine.json", 60)
    assert held == 16 and [cmd[i + 1] for i, a in enumerate(cmd) if a == "--rows"] == ["16"]
    # two samplers share a step's groups: each holds at most its sampler.max_groups_per_version of them
    _, held = engine_command([*args, "sampler.replicas=2"], mode_overrides("sync", 8, 2), tmp_path / "cache",
                             tmp_path / "engine.json", 60)
    assert held == 16


def test_the_engine_the_one_process_run_and_the_plan_may_miss_the_deadline_on_a_gpu():
    phases = {"colocated": {"status": "skipped", "reason": "deadline"}, "plan": {"status": "stopped"},
              "engine": {"status": "skipped", "reason": "deadline"}}
    missing = missing_figures(phases, device_memory=True, optional=("engine", "colocated", "plan"))
    assert not [m for m in missing if m.startswith(("colocated", "plan", "comparison.engine", "comparison.sampler"))]
    strict = missing_figures(phases, device_memory=True)
    assert "colocated: no figures (skipped)" in strict and "comparison.sampler_over_engine_sync_same_rows" in strict


def test_gsm8k_shaped_problems_load_as_gsm8k(tmp_path, monkeypatch):
    directory = write_gsm8k_shaped(tmp_path / "g", rows=60)
    train, test = load_problems(str(directory), "train"), load_problems(str(directory), "test")
    assert len(train) == 60 and len(test) == 10
    assert all(p.answer.isdigit() and 40 <= len(p.question.split()) <= 80 for p in train)
    monkeypatch.setenv("GRPO_STREAM_GSM8K_DIR", str(directory))
    assert gsm8k_source(None, tmp_path)[0] == directory.resolve()


def test_the_rate_while_generating_counts_every_token_the_engine_made():
    """Rows cancelled when the run ended were decoded in generate_seconds but sent in no group: the engine alone is
    credited with every token it makes, so the sampler is too (its engine's count); vLLM keeps none: the tokens sent."""
    s = sampler_figures({**SAMPLER, "engine_tokens_decoded": 1400})
    assert (s["tokens_per_second_generating"], s["tokens_per_second"]) == (350.0, 120.0)
    assert sampler_figures({**SAMPLER, "engine_tokens_decoded": None})["tokens_per_second_generating"] == 300.0


def test_a_sampler_summary_counts_the_tokens_its_engine_decoded(tiny_parts):
    from grpo_stream.common.engine.base import tokens_decoded
    from grpo_stream.common.engine.continuous import ContinuousEngine

    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, -1, 16, 6, temperature=1.0, slots=4, chunk_steps=2)
    out = engine.generate(model.params, [tok.encode("1+1=")] * 3, jax.random.key(0))
    assert tokens_decoded(engine) == sum(len(t) for t in out.tokens) == 18  # no stop token: every budget spent
    assert tokens_decoded(object()) is None  # an engine without counters (vLLM)
