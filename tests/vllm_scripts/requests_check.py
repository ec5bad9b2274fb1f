"""Runs in the vLLM environment (started by tests/unit/common/engine/test_vllm_requests.py): how the vLLM engine
samples, ends and drops requests, on a tiny Qwen2 whose config.json names a second EOS (a token the policy emits
often) that the tokenizer does not, with no generation_config.json (vLLM then takes config.json's). Writes the
measurements as JSON; the test asserts on them.

    python -m tests.vllm_scripts.requests_check MODEL_DIR OUT.json      (from the repository root)

- sampled rows in one serve with greedy rows: their logprobs are the policy's (greedy rows' are vLLM's at temperature
  1, reported as measured);
- completions end at the tokenizer's stop tokens only, as the JAX engine's do (greedy: the same tokens, lengths and
  `finished`), never at the model directory's other EOS;
- a request withdrawn mid-decode frees its place for a waiting one; a cancelled serve leaves nothing in the engine;
- a prompt of exactly generation.max_prompt_tokens decodes its whole budget; a longer one is refused by name.
"""

import json
import pathlib
import sys

import numpy as np

from tests.vllm_scripts.script_source import FixedSetSource

P, C, TEMPERATURE = 24, 16, 0.7


class Row:
    """A request's tag (the endpoint's are objects too: withdrawal matches them by identity)."""

    def __init__(self, index: int):
        self.index = index


class StepSource(FixedSetSource):
    """A fixed request set that counts the engine's scheduling points (`take` calls), withdraws the tags in
    `withdraw_at[step]` at that step and cancels at step `cancel_at`."""

    def __init__(self, requests, withdraw_at=None, cancel_at=None):
        self.requests, self.withdraw_at, self.cancel_at = list(requests), withdraw_at or {}, cancel_at
        self.steps, self.gone, self.results = 0, [], {}

    def take(self):
        self.steps += 1
        self.gone += self.withdraw_at.get(self.steps, [])
        taken, self.requests = self.requests, []
        return taken

    def withdrawn(self):
        return list(self.gone)

    def finish(self, request, tokens, logprobs, versions, finished):
        self.results[request.tag.index] = (np.asarray(tokens).tolist(), bool(finished))

    def cancelled(self):
        return self.cancel_at is not None and self.steps >= self.cancel_at


def logprob_diff(model, pad_id, prompts, tokens, lengths, logprobs) -> float:
    """Largest |engine logprob - the trainer's recomputation at TEMPERATURE| over the completions' tokens."""
    import jax.numpy as jnp

    from grpo_stream.common.model.policy import sequence_logprobs

    full = np.full((len(prompts), P + C), pad_id, np.int32)
    valid = np.zeros(full.shape, np.bool_)
    for i, ids in enumerate(prompts):
        n = int(lengths[i])
        full[i, P - len(ids):P], full[i, P:P + n] = ids, tokens[i][:n]
        valid[i, P - len(ids):P + n] = True
    recomputed = np.asarray(sequence_logprobs(model, model.params, jnp.asarray(full), jnp.asarray(valid),
                                              TEMPERATURE, pad_id))[:, P - 1:]
    mask = np.arange(C)[None, :] < np.asarray(lengths)[:, None]
    return float(np.abs(np.where(mask, recomputed - np.asarray(logprobs), 0.0)).max())


def second_eos(model_dir: pathlib.Path, token: int) -> None:
    """config.json's eos_token_id becomes [the tokenizer's EOS, token]; generation_config.json goes."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    config["eos_token_id"] = (eos if isinstance(eos, list) else [eos]) + [token]
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").unlink(missing_ok=True)


def sampling_figures(engine, jax_engine, model, tok, prompts) -> dict:
    """Greedy rows alone and mixed with sampled rows in one serve, against the recomputation and the JAX engine."""
    import jax

    from grpo_stream.common.engine.base import FixedRequests, Generation, Request

    greedy = engine.generate(model.params, prompts, 0, greedy=True)
    reference = jax_engine.generate(model.params, prompts, jax.random.key(0), greedy=True)
    rows = [prompts[i % len(prompts)] for i in range(2 * len(prompts))]
    mixed = Generation(np.zeros((len(rows), C), np.int32), np.zeros((len(rows), C), np.float32),
                       np.zeros(len(rows), np.int32), np.zeros(len(rows), np.bool_), None)
    engine.serve(model.params, FixedRequests([Request(list(ids), C, 100 + i, i, greedy=i % 2 == 0)
                                              for i, ids in enumerate(rows)], mixed))
    halves = {"mixed_greedy": slice(0, None, 2), "mixed_sampled": slice(1, None, 2)}
    result = {f"{name}_logprob_diff": logprob_diff(model, tok.pad_id, rows[part], mixed.tokens[part],
                                                   mixed.lengths[part], mixed.logprobs[part])
              for name, part in halves.items()}
    ended = [bool(f) == (int(n) < C or int(t[n - 1]) in tok.eos_ids)
             for t, n, f in zip(mixed.tokens, mixed.lengths, mixed.finished)]
    return dict(result, greedy_logprob_diff=logprob_diff(model, tok.pad_id, prompts, greedy.tokens, greedy.lengths,
                                                         greedy.logprobs),
                greedy_tokens=[greedy.tokens[i, :n].tolist() for i, n in enumerate(greedy.lengths)],
                greedy_finished=greedy.finished.tolist(),
                jax_tokens=[reference.tokens[i, :n].tolist() for i, n in enumerate(reference.lengths)],
                jax_finished=reference.finished.tolist(), mixed_finished_exact=all(ended))


def request_figures(engine, model, prompts) -> dict:
    """Withdrawal, cancellation and prompt lengths at the edge (the engine runs 2 requests at once)."""
    from grpo_stream.common.engine.base import Request

    llm = engine.llm.llm_engine
    alone = StepSource([Request(list(prompts[2]), C, 0, Row(2), greedy=True)])
    engine.serve(model.params, alone)
    rows = [Row(i) for i in range(3)]
    # rows 0 and 1 decode; row 2 waits in vLLM until row 0, withdrawn at step 3, leaves
    withdrawing = StepSource([Request(list(prompts[i]), C, 0, rows[i], greedy=True) for i in range(3)],
                             withdraw_at={3: [rows[0]]})
    engine.serve(model.params, withdrawing)
    result = dict(withdrawn_results=sorted(withdrawing.results), withdraw_steps=withdrawing.steps,
                  waiting_row_as_alone=withdrawing.results.get(2) == alone.results[2],
                  unfinished_after_withdraw=llm.get_num_unfinished_requests())
    cancelling = StepSource([Request(list(prompts[i]), C, 0, Row(i), greedy=True) for i in range(3)], cancel_at=4)
    engine.serve(model.params, cancelling)
    again = StepSource([Request(list(prompts[2]), C, 0, Row(2), greedy=True)])
    engine.serve(model.params, again)
    result.update(cancelled_results=len(cancelling.results), unfinished_after_cancel=llm.get_num_unfinished_requests(),
                  after_cancel_as_alone=again.results == alone.results)
    edge = StepSource([Request(((prompts[0] * P)[:P]), C, 0, Row(0), greedy=True)])
    engine.serve(model.params, edge)
    result["full_prompt_result"] = edge.results[0]
    try:
        engine.serve(model.params, StepSource([Request((prompts[0] * P)[:P + 1], C, 0, Row(0), greedy=True)]))
        result["long_prompt_error"] = None
    except ValueError as exc:
        result["long_prompt_error"] = str(exc)
    return result


def main(model_dir: str, out_path: str) -> None:
    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine.continuous import ContinuousEngine
    from grpo_stream.common.engine.vllm_engine import VllmEngine
    from grpo_stream.common.model.policy import load_hf_model
    from grpo_stream.common.model.tokenizer import HFTokenizer
    from grpo_stream.common.tasks.arith import ArithTask

    import jax

    model_dir = pathlib.Path(model_dir)
    tok, model = HFTokenizer(model_dir), load_hf_model(model_dir)
    prompts = [tok.encode(p.prompt) for p in ArithTask(10, 99, 0.1, seed=0).heldout(4)]
    jax_engine = ContinuousEngine(model, tok.pad_id, tok.eos_ids, P, C, TEMPERATURE)
    first = int(jax_engine.generate(model.params, prompts, jax.random.key(0), greedy=True).tokens[0, 0])
    second_eos(model_dir, first)  # the policy's first greedy token: vLLM would end row 0 there
    engine = VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, P, C, TEMPERATURE,
                        VllmSection(kv_cache_gib=0.1, enforce_eager=True, max_num_seqs=2))
    result = dict(tokenizer_eos=tok.eos_ids, config_eos=json.loads((model_dir / "config.json").read_text())[
        "eos_token_id"], second_eos=first)
    result.update(sampling_figures(engine, jax_engine, model, tok, prompts))
    result.update(request_figures(engine, model, prompts))
    pathlib.Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":  # the vLLM engine core may spawn processes: the guard is required
    main(*sys.argv[1:3])
