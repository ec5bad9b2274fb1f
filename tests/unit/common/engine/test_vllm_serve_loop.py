"""The vLLM engine's own code around vLLM, run against a stand-in of the few vLLM objects it drives (no vLLM needed):
what its serve holds on to, and what a failed start leaves behind. vLLM itself: test_vllm_engine.py and the scripts
in tests/vllm_scripts/."""

import dataclasses
import sys
import tempfile
import types

import numpy as np
import pytest

from grpo_stream.common.config.vllm_settings import VllmSection
from grpo_stream.common.engine import vllm_engine
from grpo_stream.common.engine.base import FixedRequests, Generation, Request
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.policy import build_from_architecture
from grpo_stream.common.runtime.errors import PermanentError
from tests.version_swap import VersionSwap

TOKEN, BUDGET = 3, 12


class _Engine:
    """vLLM's LLMEngine as the serve drives it: one token per live request a step (TOKEN, logprob -1), a request
    finished at its max_tokens; DELTA requests return each step's token, FINAL_ONLY ones their whole output."""

    def __init__(self):
        self.requests: dict[str, dict] = {}

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = {"params": params, "tokens": [], "sent": 0}

    def step(self):
        outs = []
        for rid, r in list(self.requests.items()):
            r["tokens"].append(TOKEN)
            done = len(r["tokens"]) >= r["params"].max_tokens
            delta = r["params"].output_kind == "delta"
            if delta or done:
                new = r["tokens"][r["sent"]:] if delta else r["tokens"]
                r["sent"] = len(r["tokens"])
                logprobs = [{TOKEN: types.SimpleNamespace(logprob=-1.0)} for _ in new]
                out = types.SimpleNamespace(token_ids=list(new), logprobs=logprobs,
                                            finish_reason="length" if done else None)
                outs.append(types.SimpleNamespace(request_id=rid, finished=done, num_cached_tokens=0, outputs=[out]))
            if done:
                del self.requests[rid]
        return outs

    def abort_request(self, ids):
        for rid in ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)


class _LLM:
    """vllm.LLM: started with the engine's arguments (`fail`: its start raises instead); weights load into nothing."""

    fail: Exception | None = None
    starts = 0

    def __init__(self, **kwargs):
        _LLM.starts += 1
        if _LLM.fail is not None:
            raise _LLM.fail
        self.kwargs, self.llm_engine = kwargs, _Engine()

    def collective_rpc(self, method, kwargs=None):
        return [0]

    def reset_prefix_cache(self):
        return True

    def sleep(self, level, mode):
        pass

    def wake_up(self, tags):
        pass


@dataclasses.dataclass
class _EngineArgs:  # vllm.engine.arg_utils.EngineArgs: where vllm.LLM's **kwargs go
    max_num_batched_tokens: int = 0
    async_scheduling: bool = True


@pytest.fixture
def fake_vllm(monkeypatch):
    """`vllm`, `vllm.platforms` (a CPU), `vllm.sampling_params` and `vllm.engine.arg_utils` as the engine imports
    them."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = _LLM, types.SimpleNamespace
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_tpu=lambda: False, is_cpu=lambda: True)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = _EngineArgs
    for name, module in (("vllm", vllm), ("vllm.platforms", platforms), ("vllm.sampling_params", sampling),
                         ("vllm.engine", types.ModuleType("vllm.engine")), ("vllm.engine.arg_utils", arg_utils)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine sets it: restored after the test
    monkeypatch.setattr(_LLM, "fail", None)
    monkeypatch.setattr(_LLM, "starts", 0)
    return _LLM


def _model():
    arch = Architecture(family="qwen2", vocab_size=64, num_layers=1, embed_dim=16, hidden_dim=32, num_heads=2,
                        num_kv_heads=1, head_dim=8, norm_eps=1e-6, rope_theta=1e4, tied_embeddings=True)
    return build_from_architecture(arch, seed=0)


def _engine(model, settings=None) -> vllm_engine.VllmEngine:
    return vllm_engine.VllmEngine("/no-model-dir", model, 0, [1], 8, BUDGET, 1.0,
                                  settings or VllmSection(steps_between_updates=1))


def test_a_serve_frees_its_first_version_once_a_newer_one_is_installed_in_flight(fake_vllm):
    """The sampler hands its serve the first weights in a FirstWeights so that nothing keeps them once a newer version
    replaces them: on vLLM a whole host copy of the weights for the sampler's life (test_engine_thread.py: the same
    for the JAX engine)."""
    model = _model()
    engine, swap = _engine(model), VersionSwap(model.params)
    out = Generation(np.zeros((2, BUDGET), np.int32), np.zeros((2, BUDGET), np.float32), np.zeros(2, np.int32),
                     np.zeros(2, bool), np.full((2, BUDGET), -1, np.int32))
    source = FixedRequests([Request([5, 6], BUDGET, i, i) for i in range(2)], out)
    engine.serve(swap.first_weights(), source, swap.refresh, 0)
    assert engine.pauses == 1 and engine._installed is swap.second
    assert out.lengths.tolist() == [BUDGET, BUDGET] and set(out.versions[:, -1].tolist()) == {1}
    assert swap.alive_after_update == [0]


def test_a_failed_start_leaves_no_stage_directory_behind(fake_vllm, tmp_path):
    # weight_install=files: the engine's own directory inside a stage_dir that several samplers of a host share
    # (/dev/shm); a sampler restarted after each failed start (vLLM out of memory) would add one every time
    fake_vllm.fail = RuntimeError("simulated: not enough memory for the KV cache")
    stage = tmp_path / "shm"
    with pytest.raises(RuntimeError, match="simulated"):
        _engine(_model(), VllmSection(weight_install="files", stage_dir=str(stage)))
    assert list(stage.iterdir()) == []


def test_a_failed_start_of_the_tiny_model_leaves_no_model_directory_behind(fake_vllm, tiny_parts, tmp_path,
                                                                           monkeypatch):
    # model.kind=tiny: build writes the config.json vLLM builds the model from into a directory the engine owns
    cfg, _task, tok, model = tiny_parts
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fake_vllm.fail = RuntimeError("simulated: not enough memory for the KV cache")
    with pytest.raises(RuntimeError, match="simulated"):
        vllm_engine.build(cfg, model, tok)
    assert list(tmp_path.iterdir()) == []


def test_an_engine_arg_this_vllm_does_not_take_is_refused_naming_the_field_before_vllm_starts(fake_vllm, tmp_path):
    # sampler.vllm.engine_args is a free mapping (the config loads without vLLM): vLLM's own refusal is a TypeError
    # naming EngineArgs, which the sampler's restarts meet again every time
    stage = tmp_path / "shm"
    settings = VllmSection(weight_install="files", stage_dir=str(stage),
                           engine_args={"max_num_batched_token": 64, "swap_space": 0})
    with pytest.raises(PermanentError, match=r"sampler\.vllm\.engine_args names \['max_num_batched_token', "
                                             r"'swap_space'\], which this vLLM's LLM does not take "
                                             r"\(max_num_batched_token: did you mean max_num_batched_tokens\?\)"):
        _engine(_model(), settings)
    assert fake_vllm.starts == 0 and list(stage.iterdir()) == []


def test_a_failed_start_names_the_settings_behind_vllms_arguments(fake_vllm):
    fake_vllm.fail = ValueError("the KV cache needs 2.0 GiB: increase `gpu_memory_utilization` or decrease "
                                "`max_model_len`")
    settings = VllmSection(gpu_memory_utilization=0.3, max_num_seqs=4, engine_args={"async_scheduling": False})
    with pytest.raises(RuntimeError) as caught:
        _engine(_model(), settings)
    message = str(caught.value)
    assert message.startswith("vLLM did not start (ValueError: the KV cache needs 2.0 GiB: increase")
    for part in (f"max_model_len={8 + BUDGET} (generation.max_prompt_tokens + generation.max_new_tokens",
                 "gpu_memory_utilization=0.3 (sampler.vllm.gpu_memory_utilization)", "dtype='float32' (sampler.dtype)",
                 "max_num_seqs=4 (sampler.vllm.max_num_seqs)", "enforce_eager=False (sampler.vllm.enforce_eager)",
                 "async_scheduling=False (sampler.vllm.engine_args)"):
        assert part in message, (part, message)
    assert "load_format" not in message and "logprobs_mode" not in message  # the engine's own, no setting's
    assert isinstance(caught.value.__cause__, ValueError)
