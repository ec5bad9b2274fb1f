"""Evaluation on held-out problems with the sampling engine: greedy pass@1, and pass@k / maj@k from k samples.

- pass@1 (greedy): share of problems whose greedy completion is correct.
- pass@k: the unbiased estimator of Chen et al. (2021) from n = `samples`
  completions per problem of which c are correct: 1 - C(n-c, k) / C(n, k),
  averaged over problems, for every k in `ks` (k <= n).
- maj@k: majority vote over the final answers of the first k samples
  (numbers compared after normalisation, `grpo_stream.common.tasks.answers`); a problem counts
  when the most frequent answer is correct, ties going to the answer seen
  first. Completions that state no answer do not vote.
- task metrics: a task's own figures of the greedy completions (`task_metrics`, e.g. IFEval's four).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import jax

from grpo_stream.common.tasks.answers import extract_answer, same_number
from grpo_stream.common.engine.base import GenerationEngine
from grpo_stream.common.tasks.rewards import answer_correct, answer_format


@dataclasses.dataclass
class EvalResult:
    accuracy: float                       # greedy pass@1
    format_rate: float                    # greedy completions stating `#### N`
    num_problems: int
    seconds: float
    examples: list[dict]
    samples: int = 0                      # sampled completions per problem (0: greedy only)
    skipped_long_prompts: int = 0         # problems not scored: prompt longer than generation.max_prompt_tokens
    pass_at_k: dict[str, float] = dataclasses.field(default_factory=dict)
    maj_at_k: dict[str, float] = dataclasses.field(default_factory=dict)
    task_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the task's own figures (greedy)

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


def _generate(engine: GenerationEngine, params: Any, tokenizer, prompts: list[list[int]], batch_size: int, rng, greedy: bool,
              progress: Callable[[], None] | None = None, episodes=None, problems: list | None = None):
    """Completion texts for `prompts`, generated `batch_size` at a time (a fixed-shape engine's last batch padded:
    one compiled shape); `progress` is called after each batch (a heartbeat). With `episodes` (an EpisodeRunner:
    environment.name) each prompt is a multi-turn episode of problems[i] and its text is its model turns'."""
    texts = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        rng, sub = jax.random.split(rng)
        if episodes is not None:
            results, _ = episodes.run(engine, params, problems[i:i + batch_size], chunk, sub, greedy=greedy)
            texts += [r.model_text for r in results]
        else:
            padded = chunk + [chunk[-1]] * (batch_size - len(chunk)) if engine.fixed_shape else chunk
            out = engine.generate(params, padded, sub, greedy=greedy)
            texts += [tokenizer.decode(out.tokens[j, :out.lengths[j]].tolist()) for j in range(len(chunk))]
        if progress is not None:
            progress()
    return texts


def evaluate(engine: GenerationEngine, params: Any, tokenizer, problems: list, batch_size: int, num_examples: int = 3,
             samples: int = 0, ks: Sequence[int] = (), seed: int = 0,
             progress: Callable[[], None] | None = None, episodes=None,
             task_metrics: Callable[[list, list[str]], dict[str, float]] | None = None) -> EvalResult:
    """Greedy pass@1 on `problems` (each has .prompt and .answer); with `samples` > 0 also pass@k and maj@k.

    Problems whose prompt exceeds the engine's max_prompt_tokens are skipped and counted. `progress`: called after
    every generated batch (a heartbeat); `episodes`: an EpisodeRunner, each problem a multi-turn episode;
    `task_metrics(problems, greedy completions)`: the task's own figures (a task's `eval_metrics`)."""
    start = time.time()
    if not problems:
        raise ValueError("no problems to evaluate (eval.num_problems / --limit, and the split's size)")
    encoded = [tokenizer.encode(p.prompt) for p in problems]
    keep = [i for i, ids in enumerate(encoded) if len(ids) <= engine.max_prompt_tokens]
    skipped = len(problems) - len(keep)  # longer than generation.max_prompt_tokens: not scored, counted
    problems, prompts = [problems[i] for i in keep], [encoded[i] for i in keep]
    if not problems:
        raise ValueError(f"generation.max_prompt_tokens={engine.max_prompt_tokens}: every evaluation prompt is "
                         "longer; raise it")
    greedy = _generate(engine, params, tokenizer, prompts, batch_size, jax.random.key(seed), greedy=True,
                       progress=progress, episodes=episodes, problems=problems)
    correct = [answer_correct(t, p.answer) for t, p in zip(greedy, problems)]
    formatted = [answer_format(t, p.answer) for t, p in zip(greedy, problems)]
    examples = [{"prompt": p.prompt, "completion": t, "answer": p.answer, "correct": bool(c)}
                for p, t, c in list(zip(problems, greedy, correct))[:num_examples]]
    n = len(problems)
    result = EvalResult(accuracy=sum(correct) / n, format_rate=sum(formatted) / n, num_problems=n,
                        seconds=0.0, examples=examples, samples=samples, skipped_long_prompts=skipped,
                        task_metrics=task_metrics(problems, greedy) if task_metrics else {})
    if samples:
        bad = [k for k in ks if not 0 < k <= samples]
        if bad:
            raise ValueError(f"eval.ks={list(ks)}: each k must be in 1..eval.samples={samples}")
        repeated = [ids for ids in prompts for _ in range(samples)]
        texts = _generate(engine, params, tokenizer, repeated, batch_size, jax.random.key(seed + 1), greedy=False,
                          progress=progress, episodes=episodes, problems=[p for p in problems for _ in range(samples)])
        per_problem = [texts[i * samples:(i + 1) * samples] for i in range(n)]
        for k in ks:
            result.pass_at_k[str(k)] = sum(
                pass_at_k(samples, int(sum(answer_correct(t, p.answer) for t in texts_i)), k)
                for p, texts_i in zip(problems, per_problem)) / n
            result.maj_at_k[str(k)] = sum(
                majority_correct([extract_answer(t) for t in texts_i[:k]], p.answer)
                for p, texts_i in zip(problems, per_problem)) / n
    result.seconds = round(time.time() - start, 3)
    return result


def greedy_probe(engine: GenerationEngine, params: Any, tokenizer, problems: list, batch_size: int,
                 progress: Callable[[], None] | None = None) -> list[str]:
    """Greedy completions of the problems whose prompts fit: what two copies of the same weights must agree on."""
    prompts = [ids for ids in (tokenizer.encode(p.prompt) for p in problems) if len(ids) <= engine.max_prompt_tokens]
    return (_generate(engine, params, tokenizer, prompts, batch_size, jax.random.key(0), greedy=True, progress=progress)
            if prompts else [])
