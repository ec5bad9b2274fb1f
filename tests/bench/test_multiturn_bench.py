"""`grpo-stream bench multiturn --quick` (issue 45) end to end: both arms ran the same episodes (same model tokens,
same digest), every figure is in the JSON, episodes have 3-5 turns. A check that it works, not a speed test: the
figures are in BENCHMARKS.md."""

import json
import subprocess
import sys

import pytest

from tests.e2e.test_up import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # the bench lane (-m bench)


def test_multiturn_quick_runs_identical_workloads_with_and_without_tool_latency(tmp_path):
    out, table = tmp_path / "multiturn.json", tmp_path / "results.md"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream", "bench", "multiturn", "--quick", "--json", str(out),
                           "--table", str(table)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]  # an unmet target is no failure: no timing is asserted
    result = json.loads(out.read_text())
    assert result["benchmark"] == "multiturn" and result["quick"] is True and "error" not in result
    assert result["targets"]["ratio_latency_over_zero"]["target"] == ">= 0.8"
    assert isinstance(result["targets"]["ratio_latency_over_zero"]["met"], bool)
    assert result["ratio_latency_over_zero"] == pytest.approx(
        result["tokens_per_second"]["latency"] / result["tokens_per_second"]["zero"], rel=0.01)
    assert result["episodes"] == 16 and result["tool_latency_s"] == 0.1
    for key in ("run_seconds", "environment_seconds", "tokens_per_second"):
        assert set(result[key]) == {"zero", "latency"} and all(v >= 0 for v in result[key].values())
    assert result["environment_seconds"]["latency"] >= 0.1 * result["tool_calls"] * 0.9  # the sleeps were there
    assert 0 <= result["latency_not_hidden_share"] < 1 and result["engine_idle_seconds"]["latency"] > 0
    assert result["programs_compiled_while_timed"] >= 0 and result["turn_prompt_tokens"] > result["turns"]

    runs = [r for arm in ("zero", "latency") for r in result["runs"][arm]] + list(result["warmup"].values())
    assert len(result["runs"]["zero"]) == len(result["runs"]["latency"]) == 1
    # identical workloads: same keys, same episodes, so the same tokens whatever the tool's latency
    assert result["identical_workloads"] and len({r["tokens_sha256"] for r in runs}) == 1
    assert len({r["model_tokens"] for r in runs}) == 1 and result["model_tokens"] > 0
    assert all(r["errors"] == 0 and r["turns"] == result["turns"] for r in runs)
    per_episode = result["runs"]["zero"][0]["turns_per_episode"]
    assert len(per_episode) == 16 and all(3 <= t <= 5 for t in per_episode) and len(set(per_episode)) > 1
    assert result["turns"] == sum(per_episode) and result["turns_per_episode"]["min"] >= 3
    # every turn after an episode's first re-entered the engine and was prefilled again
    assert all(r["prefill_rows"] == r["turns"] for r in runs)
    assert result["model_tokens"] <= result["turns"] * result["workload"]["turn_tokens"]
    assert result["engine"]["programs_compiled"] > 0 and result["model"]["parameters"] > 0
    assert " | multiturn | quick | ratio_latency_over_zero " in table.read_text()
