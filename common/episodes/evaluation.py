"""Evaluation on held-out problems with the sampling engine, through the rollout stream of any rollout kind
(common/episodes): greedy pass@1, and pass@k / maj@k from k samples.

- pass@1 (greedy): share of problems whose greedy completion is correct.
- pass@k: the unbiased estimator of Chen et al. (2021) from n = `samples`
  completions per problem of which c are correct: 1 - C(n-c, k) / C(n, k),
  averaged over problems, for every k in `ks` (k <= n).
- maj@k: majority vote over the final answers of the first k samples
  (numbers compared after normalisation, `grpo_stream.common.tasks.answers`); a problem counts
  when the most frequent answer is correct, ties going to the answer seen
  first. Completions that state no answer do not vote.
- reward: the mean reward of the greedy episodes by the run's rewards (task.rewards, recorded as `reward_weights`
  beside it, and each reward's own mean in `reward_components`), or by the rubric of a kind that scores its own
  episodes (a verifiers environment). This is the run's own measure of success: `accuracy` is `answer_correct`
  (`#### N` and the other explicit answer formats) whatever the run rewards, which a chat-form run rewarding
  `last_number` may never write.
- task metrics: a task's own figures of the greedy completions (`task_metrics`, e.g. IFEval's four).

Every figure reads what the run's rewards read: an episode's final model turn (groups.py `answer_text`). Scoring
runs on the trainer's process, so what reads a completion is bounded: accuracy, format rate and pass@k call
`answer_correct`/`answer_format` through `score_call` (a run's: the reward worker, with task.reward_timeout_s, as a
sampler's rewards); maj@k's answer extraction runs here, linear in the completion's length (common/tasks/answers.py:
about 0.03 s for 128k characters, any text). A task's own figures (`task_metrics`) run their checks through
`score_call` too (IFEval's are lm-eval's, whose postscript pattern is quadratic on whitespace runs: about 1 s at 16k
spaces, 4 s at 32k, unbounded in-process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Sequence

import jax

from grpo_stream.common.engine.base import GenerationEngine
from grpo_stream.common.episodes.finite import run_groups
from grpo_stream.common.episodes.registry import ROLLOUTS, build_rollouts, rollout_kind
from grpo_stream.common.registry.tasks import task_spec
from grpo_stream.common.episodes.groups import answer_text, episode_text, score_episode
from grpo_stream.common.tasks.reward_workers import RewardWorker
from grpo_stream.common.episodes.result import EpisodeResult, GroupWork, on_host
from grpo_stream.common.episodes.single_turn import SingleTurn
from grpo_stream.common.tasks.answers import extract_answer, same_number
from grpo_stream.common.tasks.rewards import RewardSet, answer_correct, answer_format

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EvalResult:
    accuracy: float                       # greedy pass@1
    format_rate: float                    # greedy completions stating `#### N`
    num_problems: int
    seconds: float
    examples: list[dict]
    samples: int = 0                      # sampled completions per problem (0: greedy only)
    skipped_long_prompts: int = 0         # problems not scored: prompt longer than generation.max_prompt_tokens
    skipped_empty_prompts: int = 0        # problems not scored: prompt of no tokens (no engine can start one)
    pass_at_k: dict[str, float] = dataclasses.field(default_factory=dict)
    maj_at_k: dict[str, float] = dataclasses.field(default_factory=dict)
    task_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the task's own figures (greedy)
    reward: float = 0.0                   # mean reward of the greedy episodes by the run's rewards (or rubric)
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)  # each component's mean
    reward_weights: dict[str, float] = dataclasses.field(default_factory=dict)  # what `reward` weighs: task.rewards
    failed_episodes: int = 0              # episodes that could not be made (a verifiers rollout that raised): 0
    sampled_reward: float | None = None   # the same over the sampled episodes (with `samples`)
    sampled_reward_components: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k completions drawn without replacement from n (c correct) is correct."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[str | None], reference: str) -> bool:
    """Whether the most frequent stated answer (numbers normalised; first seen wins ties) is the reference."""
    groups: list[tuple[str, int]] = []  # (representative answer, votes), in order of first appearance
    for ans in answers:
        if ans is None:
            continue
        for i, (rep, votes) in enumerate(groups):
            if same_number(ans, rep):
                groups[i] = (rep, votes + 1)
                break
        else:
            groups.append((ans, 1))
    if not groups:
        return False
    best = max(range(len(groups)), key=lambda i: (groups[i][1], -i))
    return same_number(groups[best][0], reference)


def _episodes(engine, params: Any, problems: list, prompts: list[list[int]], rollouts, rows: int, rng, greedy: bool,
              max_rows: int, progress: Callable[[], None] | None, rewards
              ) -> tuple[list[GroupWork], list[list[EpisodeResult]]]:
    """`rows` episodes of each problem, made by `rollouts` on one serve of `engine` (at most `max_rows` in flight):
    problem i's group samples with fold_in(rng, i), as a sampler's group of that key would."""
    keys = [jax.random.fold_in(on_host(rng), i) for i in range(len(problems))]
    works = [GroupWork(p, ids, rows, rewards, f"eval/{i}", i, key, greedy=greedy)
             for i, (p, ids, key) in enumerate(zip(problems, prompts, keys))]
    return works, run_groups(engine, params, works, rollouts, max_rows=max(max_rows, rows), progress=progress)


def _scores(works: list[GroupWork], made: list[list[EpisodeResult]], tokenizer, turn_weight: float, call=None):
    """(mean reward, each component's mean, episodes that failed) over every episode of `made`; `call`: how each
    reward runs (RewardSet.score)."""
    scored = [score_episode(r, work, tokenizer, turn_weight, call) for work, group in zip(works, made) for r in group]
    n, names = max(1, len(scored)), sorted({name for _, parts in scored for name in parts})
    return (sum(r for r, _ in scored) / n, {k: sum(parts.get(k, 0.0) for _, parts in scored) / n for k in names},
            sum(bool(r.failed) for group in made for r in group))


def evaluate(engine: GenerationEngine, params: Any, tokenizer, problems: list, batch_size: int, num_examples: int = 3,
             samples: int = 0, ks: Sequence[int] = (), seed: int = 0,
             progress: Callable[[], None] | None = None, rollouts=None, rewards: RewardSet | None = None,
             turn_weight: float = 0.0, task_metrics: Callable[..., dict[str, float]] | None = None,
             score_call=None, reward_weights: dict[str, float] | None = None) -> EvalResult:
    """Greedy pass@1 on `problems` (each has .prompt and .answer); with `samples` > 0 also pass@k and maj@k.

    Each problem is a group of episodes made by `rollouts` (the run's rollout kind, common/episodes/registry.py:
    single turns by default, an environment's episodes, a verifiers environment's rollouts), `batch_size` episodes
    in flight at a time. Problems whose prompt exceeds the engine's max_prompt_tokens, or is empty, are skipped and
    counted.
    `progress`: called as groups end (a heartbeat); `rewards`: the run's rewards (task.rewards), whose mean over the
    greedy (and sampled) episodes, with `turn_weight` x their turn rewards, is `reward` (`sampled_reward`); a kind
    that scores its own episodes (a verifiers rubric) gives its own. `task_metrics(problems, greedy completions, score_call)`:
    the task's own figures (a task's `eval_metrics`). `score_call`: how each reward runs (RewardSet.score; a run's:
    in a worker with a deadline). `reward_weights`: what `reward` weighs, for the record (default: `rewards`'
    configured weights; {} when the rollouts score their own episodes)."""
    start = time.time()
    if not problems:
        raise ValueError("no problems to evaluate (eval.num_problems / --limit, and the split's size)")
    encoded = [tokenizer.encode(p.prompt) for p in problems]
    keep = [i for i, ids in enumerate(encoded) if 0 < len(ids) <= engine.max_prompt_tokens]
    empty = sum(not ids for ids in encoded)  # no engine starts one (a sampler skips them): not scored, counted
    skipped = len(problems) - len(keep) - empty  # longer than generation.max_prompt_tokens: not scored, counted
    problems, prompts = [problems[i] for i in keep], [encoded[i] for i in keep]
    if not problems:
        raise ValueError(f"generation.max_prompt_tokens={engine.max_prompt_tokens}: every evaluation prompt is "
                         "empty or longer; raise it, or fix the data")
    if skipped or empty:  # the figures are of the rest only (the shorter problems): say so, not only in the JSON
        log.warning("evaluating %d of %d problems: %d prompts longer than generation.max_prompt_tokens=%d (raise it "
                    "to score them) and %d empty ones are not scored", len(problems), len(encoded), skipped,
                    engine.max_prompt_tokens, empty)
    rollouts = rollouts or SingleTurn(engine.max_new_tokens)
    rewards = rewards or RewardSet({"answer_correct": 1.0})
    works, made = _episodes(engine, params, problems, prompts, rollouts, 1, jax.random.key(seed), True, batch_size,
                            progress, rewards)
    greedy = [answer_text(group[0], tokenizer) for group in made]
    correct = [_scored(answer_correct, t, p.answer, score_call) for t, p in zip(greedy, problems)]
    formatted = [_scored(answer_format, t, p.answer, score_call) for t, p in zip(greedy, problems)]
    examples = [{"prompt": p.prompt, "completion": episode_text(group[0], tokenizer), "answer": p.answer,
                 "correct": bool(c)} for p, group, c in list(zip(problems, made, correct))[:num_examples]]
    n = len(problems)
    reward, components, failed = _scores(works, made, tokenizer, turn_weight, score_call)
    result = EvalResult(accuracy=sum(correct) / n, format_rate=sum(formatted) / n, num_problems=n,
                        seconds=0.0, examples=examples, samples=samples, skipped_long_prompts=skipped,
                        skipped_empty_prompts=empty,
                        reward=reward, reward_components=components, failed_episodes=failed,
                        reward_weights=dict(rewards.configured) if reward_weights is None else reward_weights,
                        task_metrics=task_metrics(problems, greedy, score_call) if task_metrics else {})
    if samples:
        bad = [k for k in ks if not 0 < k <= samples]
        if bad:
            raise ValueError(f"eval.ks={list(ks)}: each k must be in 1..eval.samples={samples}")
        works, made = _episodes(engine, params, problems, prompts, rollouts, samples, jax.random.key(seed + 1), False,
                                batch_size, progress, rewards)
        result.sampled_reward, result.sampled_reward_components, failed = _scores(works, made, tokenizer, turn_weight,
                                                                                 score_call)
        result.failed_episodes += failed
        _sampled_figures(result, problems, [[answer_text(r, tokenizer) for r in group] for group in made], ks,
                         score_call)
    result.seconds = round(time.time() - start, 3)
    return result


def _scored(reward, text: str, reference: str, call=None) -> float:
    """`reward(text, reference)` (a built-in reward) through `call` (the reward worker: bounded by its deadline, an
    overrun scores 0 as a sampler's does), or here when there is none."""
    return reward(text, reference) if call is None else call(reward.__name__, reward, text, reference)


def _sampled_figures(result: EvalResult, problems: list, per_problem: list[list[str]], ks: Sequence[int],
                     call=None) -> None:
    """pass@k and maj@k of each problem's sampled completions (`call`: how answer_correct runs, as `_scored`)."""
    n, samples = len(problems), len(per_problem[0])
    correct = [int(sum(_scored(answer_correct, t, p.answer, call) for t in texts_i))
               for p, texts_i in zip(problems, per_problem)]
    for k in ks:
        result.pass_at_k[str(k)] = sum(pass_at_k(samples, c, k) for c in correct) / n
        result.maj_at_k[str(k)] = sum(
            majority_correct([extract_answer(t) for t in texts_i[:k]], p.answer)
            for p, texts_i in zip(problems, per_problem)) / n


def greedy_probe(engine: GenerationEngine, params: Any, tokenizer, problems: list, batch_size: int,
                 progress: Callable[[], None] | None = None) -> list[str]:
    """Greedy single-turn completions of the problems whose prompts fit: what two copies of the same weights must
    agree on."""
    kept = [(p, ids) for p, ids in ((p, tokenizer.encode(p.prompt)) for p in problems)
            if 0 < len(ids) <= engine.max_prompt_tokens]
    _, made = _episodes(engine, params, [p for p, _ in kept], [ids for _, ids in kept],
                        SingleTurn(engine.max_new_tokens), 1, jax.random.key(0), True, batch_size, progress,
                        RewardSet({"answer_correct": 1.0}))
    return [episode_text(group[0], tokenizer) for group in made]


def evaluate_run(cfg, engine, params, task, tokenizer, problems: list,
                 progress: Callable[[], None] | None = None) -> EvalResult:
    """`evaluate` of a run's config: its rollout kind (an environment's episodes; a verifiers environment's rollouts
    against in-process routes over `engine`, scored by its rubric), rewards and eval section."""
    with contextlib.ExitStack() as stack:
        routes = None
        if ROLLOUTS.lookup(rollout_kind(cfg)).needs_routes:
            from grpo_stream.common.endpoint.app import in_process_routes  # noqa: PLC0415 - deferred: FastAPI, for these only

            routes = stack.enter_context(in_process_routes(cfg, engine, tokenizer))
        rollouts = build_rollouts(cfg, task, tokenizer, routes)
        stack.callback(rollouts.close)
        rewards = RewardSet(cfg.task.rewards)
        # answer_format too: format_rate is scored in the worker whatever the run rewards (answer_correct always is)
        worker = RewardWorker([*rewards.functions, answer_format.__name__, *getattr(task, "eval_rewards", ())],
                              cfg.task.reward_timeout_s, cfg.task.reward_memory_mb)
        stack.callback(worker.close)
        return evaluate(engine, params, tokenizer, problems, cfg.eval.batch_size, samples=cfg.eval.samples,
                        ks=cfg.eval.ks, seed=cfg.run.seed, progress=progress, rollouts=rollouts,
                        rewards=rewards, turn_weight=cfg.environment.turn_reward_weight,
                        task_metrics=getattr(task, "eval_metrics", None), score_call=worker.call,
                        reward_weights={} if task_spec(cfg.task.name).own_rollouts else None)  # a rubric scores
