"""Runs in the vLLM environment (started by tests/unit/common/engine/test_vllm_refusals.py): the requests the vLLM
engine refuses as the JAX engine does, and the engine serving on after each. Writes the measurements as JSON.

    python -m tests.vllm_scripts.refusals_check MODEL_DIR OUT.json      (from the repository root)

- a request with a token id outside the model's vocabulary (inside the embedding's padded rows, which vLLM without a
  tokenizer would decode silently; past them; negative), an empty prompt or a budget outside 1..max_new_tokens ends
  its serve with an error naming the field;
- one taken while another request decodes leaves nothing behind in vLLM: the next serve decodes as before.
"""

import json
import pathlib
import sys

import numpy as np

from tests.vllm_scripts.script_source import FixedSetSource

P, C = 24, 8


class ScheduledSource(FixedSetSource):
    """A fixed request set handed out over the engine's scheduling points: `batches[i]` at its i-th `take`."""

    def __init__(self, batches):
        self.batches, self.steps, self.results = list(batches), 0, {}

    def take(self):
        self.steps += 1
        return self.batches.pop(0) if self.batches else []

    def finish(self, request, tokens, logprobs, versions, finished):
        self.results[request.tag] = np.asarray(tokens).tolist()

    def open(self):
        return bool(self.batches)


def main(model_dir: str, out_path: str) -> None:
    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine.base import Request
    from grpo_stream.common.engine.vllm_engine import VllmEngine
    from grpo_stream.common.model.policy import load_hf_model
    from grpo_stream.common.model.tokenizer import HFTokenizer

    model_dir = pathlib.Path(model_dir)
    tok, model = HFTokenizer(model_dir), load_hf_model(model_dir)
    vocab = model.arch.vocab_size
    engine = VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, P, C, 0.7,
                        VllmSection(kv_cache_gib=0.1, enforce_eager=True, max_num_seqs=2))
    good = [5, 6, 7]

    def serve(*batches) -> dict:
        source = ScheduledSource(batches)
        engine.serve(model.params, source)
        return source.results

    baseline = serve([Request(good, C, 3, "good")])
    result = dict(vocab=vocab, baseline=baseline["good"], errors={})
    bad = {"padded_row": ([5, vocab + 4], C), "past_rows": ([5, vocab + 4096], C), "negative": ([-1, 5], C),
           "empty": ([], C), "budget_0": (good, 0), "budget_over": (good, C + 1)}
    for name, (ids, budget) in bad.items():
        try:
            # the bad request comes at the second scheduling point, while the good one decodes
            results = serve([Request(good, C, 3, "good")], [Request(ids, budget, 4, name)])
            result["errors"][name] = None if name not in results else f"served: {results[name]}"
        except ValueError as exc:
            result["errors"][name] = str(exc)
    result["unfinished_after"] = engine.llm.llm_engine.get_num_unfinished_requests()
    result["after"] = serve([Request(good, C, 3, "good")])["good"]
    pathlib.Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":  # the vLLM engine core may spawn processes: the guard is required
    main(*sys.argv[1:3])
