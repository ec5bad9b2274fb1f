"""Off-policy replay: the trainer's RL update fed by a seeded sampler held a fixed number of versions behind.

`grpo-stream up` decides staleness by timing (how far the samplers run ahead of the trainer), so a run that falls
apart under a loaded machine cannot be replayed. Here step t trains on groups generated, with the real engine, task
and rewards, by the weights the trainer held `staleness` steps earlier, so the whole run is a deterministic function
of (config, seed, staleness) on one machine: the reproduction of issue 44's GSPO fall, and the check of its fix
(tests/e2e/test_off_policy_replay.py; docs/objective.md, "Stale sequences and GSPO").

  python -m grpo_stream.bench.off_policy_replay --steps 100 --staleness 2-4 --eval 256 \
      algo.loss_algo=gspo-token algo.minibatches=2

prints the training accuracy, clip fraction and off-policy health per 10 steps and the held-out figures before and
after, and writes the per-step metrics as JSON (--out). The warm start is cached (--cache) between runs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import pathlib
import sys
import time

import jax
import numpy as np

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.episodes.evaluation import evaluate
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.model_parts import build_model_parts
from grpo_stream.trainer_service.learning.off_policy_health import group_index_of
from grpo_stream.trainer_service.learning.packing import packing_layout
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from grpo_stream.trainer_service.learning.warmstart import warm_start
from grpo_stream.common.runtime.files import to_json, write_atomic

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_arith.yaml"
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Replay:
    """A replayed run: per-step update metrics (with the batch's accuracy and staleness) and held-out results."""
    steps: list[dict]
    eval_before: dict | None = None
    eval_after: dict | None = None


def demo_config(*overrides: str) -> RunConfig:
    """The CPU demo's config (configs/tiny_arith.yaml) with dotted overrides."""
    return load_config(CONFIG, list(overrides))


# what the warm start's params depend on (trainer_service/learning/warmstart.py and the model it starts from)
WARM_START_SECTIONS = ("model", "task", "generation", "warmstart", "environment")


def warm_start_key(cfg: RunConfig) -> str:
    """A digest of the settings a warm start depends on: a cached one made under other settings is not this one."""
    parts = {name: getattr(cfg, name).model_dump(mode="json") for name in WARM_START_SECTIONS}
    parts.update(seed=cfg.run.seed, max_grad_norm=cfg.trainer.max_grad_norm,
                 optimizer=cfg.trainer.optimizer.model_dump(mode="json"))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def warm_started(cfg: RunConfig, parts, cache: pathlib.Path | None = None):
    """The demo's warm-started params (cfg.warmstart), from `cache` (an .npz of the leaves) when it holds the warm
    start of these settings (warm_start_key); otherwise made, and `cache` replaced by it."""
    params = parts.model.params
    treedef, key = jax.tree.structure(params), warm_start_key(cfg)
    if cache is not None and cache.exists():
        with np.load(cache) as saved:
            leaves = [f"p{i}" for i in range(treedef.num_leaves)]
            if "key" in saved.files and str(saved["key"]) == key and set(saved.files) == {"key", *leaves}:
                return jax.tree.unflatten(treedef, [jax.numpy.asarray(saved[name]) for name in leaves])
        log.warning("%s holds a warm start of other settings: making this one's", cache)
    params, _ = warm_start(parts.model, params, parts.task, parts.tokenizer, cfg)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:  # then renamed: a run stopped mid-write leaves no half cache to read back
            arrays = {f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
            np.savez(out, key=np.asarray(key), **arrays)
        os.replace(tmp, cache)
    return params


def generate_groups(cfg: RunConfig, parts, params, problems, version: int, rng, rewards: RewardSet
                    ) -> list[GroupData]:
    """One scored group of generation.num_generations completions per problem, drawn with `params`."""
    n, tok = cfg.generation.num_generations, parts.tokenizer
    prompts = [tok.encode(p.prompt) for p in problems]
    out = parts.engine.generate(params, [ids for ids in prompts for _ in range(n)], rng)
    groups = []
    for k, (problem, ids) in enumerate(zip(problems, prompts)):
        completions = []
        for j in range(k * n, (k + 1) * n):
            tokens = out.tokens[j, :int(out.lengths[j])]
            reward, parts_ = rewards.score(tok.decode(tokens.tolist()), problem.answer)
            completions.append(CompletionData(token_ids=tokens, logprobs=out.logprobs[j, :len(tokens)],
                                              reward=reward, truncated=not bool(out.finished[j]),
                                              reward_components=parts_))
        groups.append(GroupData(group_id=f"replay/{problem.prompt_id}", prompt_id=problem.prompt_id,
                                prompt_token_ids=np.asarray(ids, np.int32), completions=completions,
                                policy_version=version, sampler_id="replay", reference_answer=problem.answer))
    return groups


def new_updater(cfg: RunConfig, parts, params) -> PolicyUpdater:
    t = cfg.trainer
    return PolicyUpdater(parts.model, params, cfg.algo, t.learning_rate, t.max_grad_norm, cfg.generation.temperature,
                         parts.tokenizer.pad_id, packing_layout(cfg, 1, parts.model.arch), None, t.optimizer, t.steps)


def replay(cfg: RunConfig, parts, params, steps: int, staleness: tuple[int, int], seed: int = 0, progress=None
           ) -> tuple[Replay, object]:
    """`steps` RL updates from `params`. Each of step t's groups (trainer.groups_per_step of them) draws a staleness
    s uniformly from the inclusive range `staleness` (seeded) and is generated with the weights after update
    t - 1 - s (the starting weights while t - 1 < s), so it is exactly s versions old, as the trainer sees a sampler
    that far behind. Returns the run and its final params."""
    lo, hi = staleness
    updater = new_updater(cfg, parts, params)
    history = collections.deque([updater.params], maxlen=hi + 1)  # versions t-1-hi .. t-1, newest last
    problems = parts.task.train_stream(0, 1, start=seed * 1_000_000)
    rewards = RewardSet(cfg.task.rewards)
    draws = np.random.default_rng(seed)
    out = []
    for t in range(1, steps + 1):
        lags = draws.integers(lo, hi + 1, cfg.trainer.groups_per_step)
        batch_problems = list(itertools.islice(problems, cfg.trainer.groups_per_step))
        groups = []
        for lag in sorted(set(lags.tolist())):
            version = max(0, t - 1 - lag)
            chosen = [p for p, g in zip(batch_problems, lags) if g == lag]
            groups += generate_groups(cfg, parts, history[max(0, len(history) - 1 - lag)], chosen, version,
                                      jax.random.key(seed * 100_003 + t * 31 + lag), rewards)
        batch, stats = build_batch(groups, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens,
                                   parts.tokenizer.pad_id, cfg.algo, held_version=t - 1)
        metrics = updater.update(batch, group_index_of(groups))
        accuracy = float(np.mean([c.reward_components.get("answer_correct", 0.0)
                                  for g in groups for c in g.completions]))
        out.append({"step": t, "accuracy": accuracy,
                    "staleness": float(np.mean([t - 1 - g.policy_version for g in groups])), **stats, **metrics})
        history.append(updater.params)
        if progress is not None:
            progress(out[-1])
    return Replay(out), updater.params


def held_out(cfg: RunConfig, parts, params, problems: int = 256) -> dict:
    """Greedy accuracy and sampled pass@1 (4 samples) on the first `problems` held-out problems."""
    result = evaluate(parts.engine, params, parts.tokenizer, parts.task.heldout(problems), cfg.eval.batch_size,
                      samples=4, ks=(1,), seed=cfg.run.seed)
    return {"accuracy": result.accuracy, "pass_at_1": result.pass_at_k["1"]}


def print_run(run: Replay, every: int = 10) -> None:
    """Per `every` steps: training accuracy, clip fraction, entropy and off-policy health."""
    for i in range(0, len(run.steps), every):
        chunk = run.steps[i:i + every]
        mean = lambda key: float(np.mean([s[key] for s in chunk]))  # noqa: E731
        print(f"steps {chunk[0]['step']:>3}-{chunk[-1]['step']:>3}: acc {mean('accuracy'):.3f} staleness "
              f"{mean('staleness'):.2f} clip {mean('clip_fraction'):.4f} entropy {mean('entropy'):.3f} mismatch_kl "
              f"{mean('mismatch_kl_k3'):.4f} ess {mean('is_ess_group_mean'):.3f} ratio_p01 "
              f"{mean('is_ratio_p01'):.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--staleness", default="3", help="versions behind: N, or LO-HI drawn per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval", type=int, default=0, help="held-out problems evaluated before and after (0: none)")
    parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("/tmp/grpo-stream-replay-warm.npz"))
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = demo_config(*args.overrides)
    parts = build_model_parts(cfg)
    params = warm_started(cfg, parts, args.cache)
    start = time.time()
    before = held_out(cfg, parts, params, args.eval) if args.eval else None
    lo, _, hi = args.staleness.partition("-")
    run, final = replay(cfg, parts, params, args.steps, (int(lo), int(hi or lo)), args.seed)
    run.eval_before = before
    run.eval_after = held_out(cfg, parts, final, args.eval) if args.eval else None
    print_run(run)
    if before:
        print(f"held-out: greedy {before['accuracy']:.3f} -> {run.eval_after['accuracy']:.3f}, sampled pass@1 "
              f"{before['pass_at_1']:.3f} -> {run.eval_after['pass_at_1']:.3f}")
    print(f"{time.time() - start:.0f}s")
    if args.out:
        write_atomic(args.out, to_json(dataclasses.asdict(run), indent=1))  # whole, and strict JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
