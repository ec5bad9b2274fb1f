"""`bench sampler` without a vLLM environment: the ratio against vLLM is reported missing (None), not as 0.0 (which
claimed ours made no tokens beside it), and the runner still counts that target as not met."""

import types

from grpo_stream.bench import runner, sampler


def test_a_missing_vllm_ratio_is_none_and_unmet(monkeypatch):
    monkeypatch.setenv("GRPO_STREAM_BENCH_ENGINES", "ours,vllm")
    monkeypatch.setenv("GRPO_STREAM_VLLM_PYTHON", "/nonexistent/python")  # time_vllm: {"missing": why} per case
    monkeypatch.setattr(sampler, "build_model", lambda p: types.SimpleNamespace(num_params=lambda: 1))
    monkeypatch.setattr(sampler, "load_hf", lambda model: (None, 0.0))

    def run_case(name, model, p, prompts, budgets, timed, hf, vllm):  # the engines as run_case files them
        return {"engines": {"ours": {"tokens_per_second": 100.0}, "vllm": vllm}}

    monkeypatch.setattr(sampler, "run_case", run_case)
    result = sampler.run(quick=True)
    for case in ("longtail", "fixed"):
        assert result[case]["ratio_vs_vllm"] is None
        assert "no vLLM environment" in result[case]["engines"]["vllm"]["missing"]
    targets = runner.check_targets("sampler", result)
    assert targets["longtail.ratio_vs_vllm"] == {"value": None, "target": ">= 0.8", "met": False}
