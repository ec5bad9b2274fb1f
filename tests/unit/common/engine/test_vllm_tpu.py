"""The vllm-tpu weight writer (common/engine/vllm_tpu.py) against a stand-in of the engine's object graph: the
attribute path Tunix's vLLM sampler uses, a model runner whose nnx State holds the engine's weights sharded over 8
fake CPU devices on a 'model' axis (K/V heads repeated to the tensor-parallel width, the embedding transposed, as
the family's vLLM-JAX map declares), and `collective_rpc` / `reset_prefix_cache` that record each call. No TPU and no
tpu-inference run here: this checks the writer's side of the contract (docs/tpu.md, "vLLM on TPU (vllm-tpu)")."""

import pytest

from grpo_stream.common.engine.vllm_tpu import FAMILIES, VllmTpuWeightError, model_runner
from tests.support import child_report


@pytest.fixture(scope="module")
def report() -> dict:
    return child_report("tests.unit.common.engine.vllm_tpu_child", 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_leaf_is_written_in_the_engines_layout_in_the_required_order(report, family):
    r = report[family]
    assert r["targets"] == r["leaves"] > 20
    assert r["values_equal"] and r["dtypes"] == ["bfloat16"]  # float32 policy, bfloat16 engine
    assert r["shardings_kept"] and r["old_deleted"] and r["leaves_rebuilt"]
    # the prefix cache and the KV cache go before any weight changes; the KV cache comes back after all have
    assert r["calls"] == [["reset_prefix_cache", "old"], ["rpc:delete_kv_cache", "old"],
                          ["rpc:reinitialize_kv_cache", "new"]]
    assert r["salt_before"] is None and (r["version"], r["salt"]) == (3, "e1:3")
    assert r["second_salt"] == "e1:4" and r["second_values"]  # a new version, a new salt: no KV shared
    # in flight (live requests paused with their KV kept): the weights change, the KV cache is left alone
    assert r["keep_kv_calls"] == ["reset_prefix_cache"] and r["keep_kv_values"] and r["keep_kv_salt"] == "e1:5"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_version_that_does_not_fit_is_refused_by_name_and_changes_nothing(report, family):
    r = report[family]
    errors = r["errors"]
    assert "final_norm.w" in errors["version_lacks_a_weight"]
    assert "layers.0.attn.extra.w" in errors["unknown_source_name"]
    assert "layers.7.attn.q_proj.w" in errors["state_lacks_a_target"]
    assert "norm" in errors["state_leaf_unfilled"] and "dummy" in errors["state_leaf_unfilled"]
    assert "final_norm.w" in errors["shape_mismatch"] and "[63]" in errors["shape_mismatch"]
    assert "k_proj.w: shape [64, 8, 8] does not fit the engine's [64, 8, 16]" in errors["head_dim_differs"]
    assert r["version_after_errors"] == 4 and r["calls_after_errors"] == 6 and r["values_after_errors"]


def test_an_engine_without_the_in_process_runner_is_named():
    class Engine:  # vLLM with its engine core in another process: no model_executor here
        pass

    llm = type("Llm", (), {"llm_engine": Engine()})()
    with pytest.raises(VllmTpuWeightError, match="llm.llm_engine.model_executor.*VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        model_runner(llm)
