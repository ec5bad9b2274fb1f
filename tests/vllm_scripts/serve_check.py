"""Runs in the vLLM environment (started by tests/unit/common/engine/test_vllm_serve.py): multi-turn episodes
(the environment rollout kind, `run_episodes`) on the vLLM engine's `serve` of a rollout stream. Writes the measurements as JSON; the test asserts on them.

    python -m tests.vllm_scripts.serve_check MODEL_DIR OUT.json      (from the repository root)

- token in, token out: every later turn's prompt is the earlier turn's prompt, the ids it sampled, and the
  observation's ids;
- behaviour logprobs of the model tokens against the trainer's recomputation of the whole episode;
- prefix cache: a later turn reads the blocks its earlier turns computed (vLLM's per-request num_cached_tokens);
- the same episodes again (other environment timings, so other batches): the same tokens;
- a new version while episodes run (refresh): every model token records a version, in order.
"""

import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

P, C, TEMPERATURE, BLOCK = 24, 64, 0.9, 32


class Scripted:
    """Answers every turn with `= <turn number>` until `turns` turns, after `delay` seconds."""

    def __init__(self, turns: int, delay: float):
        self.turns, self.delay = turns, delay

    def start(self, problem):
        from grpo_stream.common.environments.base import Observation, Turn

        env = self

        class Episode:
            count = 0

            def step(self, text):
                time.sleep(env.delay)
                self.count += 1
                return Turn(Observation(f"= {self.count}") if self.count < env.turns else None, reward=0.0)
        return Episode()


class Recorder:
    """The engine, with the requests each serve took and what it handed back, in order."""

    def __init__(self, engine):
        self.engine, self.taken, self.sampled, self.released = engine, [], {}, []

    def request_keys(self, rng, rows):
        return self.engine.request_keys(rng, rows)

    def serve(self, params, source, refresh=None, version=0):
        outer = self

        class Source:
            def take(self):
                got = source.take()
                outer.taken += got
                return got

            def finish(self, request, tokens, logprobs, versions, finished):
                outer.sampled[id(request)] = np.asarray(tokens).tolist()
                source.finish(request, tokens, logprobs, versions, finished)

            def open(self):
                return source.open()

            def accepting(self):
                return source.accepting()

            def released(self):
                got = source.released()
                outer.released += got
                return got

            def cancelled(self):
                return source.cancelled()

            def wait(self, timeout):
                source.wait(timeout)

        self.taken, self.sampled, self.released = [], {}, []
        self.engine.serve(params, Source(), refresh, version)


def episode_of(request) -> int:
    """The episode a request belongs to: one group of one row per problem, at its index."""
    return request.tag.run.work.position


def turn_figures(recorder, engine, tok, prompts, results) -> dict:
    """Token in, token out (turn t + 1's prompt = turn t's prompt + its sampled ids + the observation's ids) and the
    prefix cache's hits on each later turn, against what the earlier turns computed."""
    by_episode: dict[int, list] = {}
    for request, cached in zip(recorder.taken, engine.cached_prompt_tokens):
        by_episode.setdefault(episode_of(request), []).append((request, cached))
    later, prefix_exact, observation_ids, cache_hits, cache_expected, longest_prompt = 0, True, True, [], [], 0
    for i, turns in by_episode.items():
        final = list(prompts[i]) + results[i].tokens
        for k, ((before, _), (after, cached)) in enumerate(zip(turns, turns[1:])):
            later += 1
            sampled = recorder.sampled[id(before)]
            known = list(before.ids) + sampled
            prefix_exact &= after.ids[:len(known)] == known
            reply = tok.encode(f" = {k + 1}")  # what the environment said after turn k, as the renderer wrote it
            observation_ids &= after.ids[len(known):] in (reply, [tok.eos_ids[0]] + reply)
            prefix_exact &= final[:len(after.ids)] == list(after.ids)
            longest_prompt = max(longest_prompt, len(after.ids))
            # the earlier turn computed keys and values for its prompt and all but its last sampled token; vLLM
            # caches whole blocks of them and always computes a prompt's last token itself
            cache_expected.append(min(len(known) - 1, len(after.ids) - 1) // BLOCK * BLOCK)
            cache_hits.append(int(cached))
    return dict(later_turns=later, prefix_exact=bool(prefix_exact), observation_ids=bool(observation_ids),
                cache_hits=cache_hits, cache_expected=cache_expected, longest_later_prompt=longest_prompt,
                first_turn_cache_hits=[int(c) for r, c in zip(recorder.taken, engine.cached_prompt_tokens)
                                       if len(r.ids) == len(prompts[episode_of(r)])])


def logprob_figures(model, tok, prompts, results) -> dict:
    """The behaviour logprobs of the model tokens against the trainer's recomputation of each whole episode (prompt
    left-padded to P, then the episode's tokens); observation tokens carry logprob 0."""
    import jax.numpy as jnp

    from grpo_stream.common.model.policy import sequence_logprobs

    tokens = np.full((len(prompts), P + C), tok.pad_id, np.int32)
    valid = np.zeros(tokens.shape, np.bool_)
    for i, (ids, r) in enumerate(zip(prompts, results)):
        tokens[i, P - len(ids):P], valid[i, P - len(ids):P + len(r.tokens)] = ids, True
        tokens[i, P:P + len(r.tokens)] = r.tokens
    recomputed = np.asarray(sequence_logprobs(model, model.params, jnp.asarray(tokens), jnp.asarray(valid),
                                              TEMPERATURE, tok.pad_id))[:, P - 1:]
    diffs, behaviour = [], []
    for i, r in enumerate(results):
        mask = np.array(r.model_mask)
        diffs.append(np.abs(recomputed[i, :len(mask)][mask] - np.array(r.logprobs)[mask]))
        behaviour.append(np.array(r.logprobs)[mask])
    diffs, behaviour = np.concatenate(diffs), np.concatenate(behaviour)
    return dict(model_tokens=int(diffs.size), logprob_max_abs_diff=float(diffs.max()),
                logprob_mean=float(behaviour.mean()),
                observation_logprobs_zero=all((np.array(r.logprobs)[~np.array(r.model_mask)] == 0).all()
                                              for r in results),
                errors=[r.error for r in results if r.error])


def refresh_figures(model, engine, episodes) -> dict:
    """A new version while episodes run (the weights scaled, handed over at the third check): every model token
    records a version, in order."""
    import jax

    scaled = jax.tree_util.tree_map(lambda x: x * 1.05, model.params)
    calls = {"n": 0}

    def refresh():
        calls["n"] += 1
        return (scaled, 1) if calls["n"] == 3 else None

    mixed, _ = episodes(0.02, rng=9, refresh=refresh)
    versions = [r.versions for r in mixed]
    return dict(refresh_calls=calls["n"], pauses=engine.pauses,
                versions_complete=all(len(v) == len(r.tokens) for v, r in zip(versions, mixed)),
                versions_monotone=all(all(b >= a for a, b in zip(v, v[1:])) for v in versions),
                versions_seen=sorted({x for v in versions for x in v}))


def main(model_dir: str, out_path: str) -> None:
    import jax

    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine.vllm_engine import VllmEngine
    from grpo_stream.common.environments.render import PlainRenderer
    from grpo_stream.common.episodes.finite import run_episodes
    from grpo_stream.common.episodes.tool_turns import EpisodeSettings, ToolTurns
    from grpo_stream.common.model.policy import load_hf_model
    from grpo_stream.common.model.tokenizer import HFTokenizer
    from grpo_stream.common.tasks.arith import ArithTask

    tok = HFTokenizer(model_dir)
    model = load_hf_model(model_dir)
    started = time.monotonic()
    engine = VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, P, C, TEMPERATURE,
                        VllmSection(kv_cache_gib=0.25, enforce_eager=True, max_num_seqs=4,
                                    engine_args={"block_size": BLOCK}))
    result = {"engine_start_s": time.monotonic() - started,
              "block_size": engine.llm.llm_engine.vllm_config.cache_config.block_size,
              "max_model_len": engine.llm.llm_engine.vllm_config.model_config.max_model_len}
    recorder = Recorder(engine)
    problems = ArithTask(10, 99, 0.1, seed=0).heldout(10)
    prompts = [tok.encode(p.prompt) for p in problems]
    settings = EpisodeSettings(max_turns=4, turn_max_new_tokens=16, episode_tokens=C)

    def episodes(delay: float, rng: int = 5, refresh=None, hold: bool = False):
        kind = ToolTurns(Scripted(turns=4, delay=delay), PlainRenderer(tok),
                         dataclasses.replace(settings, hold_kv=hold), tok, workers=4)
        started = time.monotonic()
        try:
            made = run_episodes(recorder, model.params, problems, prompts, kind, jax.random.key(rng), refresh=refresh)
        finally:
            kind.close()
        return made, {"turns": sum(r.turns for r in made), "episodes": len(made),
                      "seconds": time.monotonic() - started}

    results, figures = episodes(0.02)
    result.update(turns=figures["turns"], episodes=figures["episodes"], serve_s=figures["seconds"])
    result.update(turn_figures(recorder, engine, tok, prompts, results))
    result.update(logprob_figures(model, tok, prompts, results))
    # the same episodes with other environment timings: other batches, the same tokens (seeded per request)
    again, _ = episodes(0.0)
    result["same_tokens_again"] = [r.tokens for r in again] == [r.tokens for r in results]
    # environment.kv_cache=hold asks nothing of vLLM (its prefix cache keeps the turns): the same episodes, and every
    # episode's hold key taken back from the stream, none kept for the sampler's life
    held, _ = episodes(0.0, hold=True)
    result["hold_same_tokens"] = [r.tokens for r in held] == [r.tokens for r in results]
    result["hold_keys_released"], result["hold_episodes"] = len(set(recorder.released)), len(held)
    result.update(refresh_figures(model, engine, episodes))
    pathlib.Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":  # the vLLM engine core may spawn processes: the guard is required
    main(*sys.argv[1:3])
