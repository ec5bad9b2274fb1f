"""Runs in the vLLM environment (started by tests/unit/common/engine/test_vllm_install.py): weight versions the vLLM
engine must install whole or not at all, on a running engine. Writes the measurements as JSON.

    python -m tests.vllm_scripts.install_check MODEL_DIR OUT.json      (from the repository root)

- a version with a tensor of the wrong shape (in the last layer: vLLM's reload would have written the layers before
  it), and one lacking a tensor (vLLM would keep the old one, logging "Failed to load weights"), are refused naming
  the tensor, and the engine answers exactly as before each;
- whole versions install after them (a round trip back to the first version answers as the first did);
- a failure inside the write (out of memory, say) leaves the engine refusing every serve, the old version's too;
- the names the installed vLLM's LLM takes, as the engine reads them (vllm_args.accepted_args), and a
  sampler.vllm.engine_args name it does not take refused before any model loads (`args`).
"""

import json
import pathlib
import sys

import numpy as np

P, C = 24, 8
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


def main(model_dir: str, out_path: str) -> None:
    import jax

    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine import vllm_engine
    from grpo_stream.common.engine.vllm_engine import VllmEngine
    from grpo_stream.common.model.policy import load_hf_model
    from grpo_stream.common.model.tokenizer import HFTokenizer

    model_dir = pathlib.Path(model_dir)
    tok, model = HFTokenizer(model_dir), load_hf_model(model_dir)
    engine = VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, P, C, 0.7,
                        VllmSection(kv_cache_gib=0.1, enforce_eager=True, max_num_seqs=2))
    runner = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def answer(params) -> dict:
        out = engine.generate(params, PROMPTS, 0, greedy=True)
        return {"tokens": out.tokens.tolist(), "logprobs": np.round(out.logprobs, 6).tolist()}

    def answer_or_error(params) -> dict:
        try:
            return answer(params)
        except Exception as exc:  # noqa: BLE001 - recorded for the test (a model left half-loaded fails here)
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    def meta_tensors() -> list[str]:
        return [n for n, t in [*runner.model.named_parameters(), *runner.model.named_buffers()] if t.is_meta]

    hf_names = vllm_engine.to_hf_names
    keys = iter(jax.random.split(jax.random.key(1), 64))
    new = jax.tree_util.tree_map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), model.params)
    result = {"baseline": answer(model.params), "refused": {}}
    bad = {"wrong_shape": ("model.layers.1.mlp.down_proj.weight", lambda x: x[:, :-1]),
           "missing": ("model.layers.1.post_attention_layernorm.weight", None)}
    for case, (name, change) in bad.items():
        def corrupted(arch, named, name=name, change=change):
            out = hf_names(arch, named)
            if change is None:
                del out[name]
            else:
                out[name] = change(out[name])
            return out

        vllm_engine.to_hf_names = corrupted
        try:
            answer(new)
            error = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            error = {"type": type(exc).__name__, "message": str(exc), "permanent": _permanent(exc)}
        vllm_engine.to_hf_names = hf_names
        result["refused"][case] = {"error": error, "meta_tensors": meta_tensors(),
                                   "broken": getattr(engine, "broken", None), "after": answer_or_error(model.params)}
    result["new"] = answer_or_error(new)
    result["back"] = answer_or_error(model.params)

    # a failure inside the write itself: vLLM's reload ends part-way (here its last step)
    from vllm.model_executor.model_loader.reload import layerwise

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("simulated: out of memory")

    finalize, layerwise.finalize_layerwise_reload = layerwise.finalize_layerwise_reload, out_of_memory
    try:
        answer(new)
        result["write_failure"] = None
    except RuntimeError as exc:
        result["write_failure"] = str(exc)
    layerwise.finalize_layerwise_reload = finalize
    result["served_after_write_failure"] = {}
    for version, params in (("old", model.params), ("new", new)):
        try:
            result["served_after_write_failure"][version] = answer(params)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            result["served_after_write_failure"][version] = f"{type(exc).__name__}: {exc}"
    result["args"] = _args_check()
    pathlib.Path(out_path).write_text(json.dumps(result))


def _args_check() -> dict:
    """What the engine's vLLM arguments are against the names the installed vLLM takes."""
    from vllm import LLM

    from grpo_stream.common.config.vllm_settings import VLLM_RESERVED_ARGS, VllmSection
    from grpo_stream.common.engine.vllm_args import accepted_args, engine_args
    from grpo_stream.common.engine.vllm_engine import VllmEngine

    accepted = accepted_args(LLM)

    class Cpu:
        @staticmethod
        def is_cpu():
            return True

    ours = engine_args(VllmSection(kv_cache_gib=1), Cpu, True, "files", 64)  # every argument the engine may add
    try:
        VllmEngine("/no-model-dir", None, 0, [1], 8, 8, 1.0, VllmSection(engine_args={"swap_space": 0}))
        refused = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        refused = {"type": type(exc).__name__, "message": str(exc)}
    return {"reserved_not_taken": sorted(set(VLLM_RESERVED_ARGS) - accepted),
            "engine_added_not_taken": sorted(set(ours) - accepted), "engine_added": sorted(ours),
            "count": len(accepted), "swap_space": "swap_space" in accepted, "refused": refused}


def _permanent(exc: BaseException) -> bool:
    from grpo_stream.common.runtime.errors import PermanentError

    return isinstance(exc, PermanentError)


if __name__ == "__main__":  # the vLLM engine core may spawn processes: the guard is required
    main(*sys.argv[1:3])
