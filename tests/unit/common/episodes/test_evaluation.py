"""pass@k and maj@k: the estimators by hand and by brute force, then on the real engine."""

import itertools
import random

import pytest

from grpo_stream.common.episodes.evaluation import evaluate, majority_correct, pass_at_k
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.tasks.rewards import RewardSet, last_number, scored_by


def test_pass_at_k_matches_enumeration_of_all_subsets():
    rng = random.Random()
    for _ in range(20):
        n = rng.randint(1, 8)
        c, k = rng.randint(0, n), rng.randint(1, n)
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_edges_and_bad_arguments():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 1, 1) == 0.25
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize("answers, reference, correct", [
    (["12", "1,2", "13", "12.0"], "12", True),      # 12 (three ways of writing it) beats 13
    (["13", "13", "12", "12"], "12", False),        # a tie goes to the answer seen first
    (["12", "13", "13", "12"], "12", True),
    ([None, None, "7"], "7", True),                 # no-answer completions do not vote
    ([None, None], "7", False),
    (["$1,000", "1000.00", "999"], "1000", True),
])
def test_majority_vote(answers, reference, correct):
    assert majority_correct(answers, reference) is correct


def test_evaluate_reports_pass_and_maj_at_k_on_the_engine(tiny_parts):
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens,
                    temperature=1.0)
    problems = task.heldout(6)
    result = evaluate(engine, model.params, tok, problems, batch_size=8, samples=4, ks=(1, 2, 4))
    assert result.num_problems == 6 and result.samples == 4
    assert set(result.pass_at_k) == set(result.maj_at_k) == {"1", "2", "4"}
    # pass@k never decreases with k; every figure is a share
    assert result.pass_at_k["1"] <= result.pass_at_k["2"] <= result.pass_at_k["4"] <= 1.0
    assert all(0.0 <= v <= 1.0 for v in [*result.maj_at_k.values(), result.accuracy])
    with pytest.raises(ValueError, match=r"eval.ks=\[8\]"):
        evaluate(engine, model.params, tok, problems, batch_size=8, samples=4, ks=(8,))


def test_evaluation_scores_by_the_runs_rewards_and_says_which(tiny_parts):
    """The held-out figure is the run's own reward (task.rewards, each reward's figure kept), recorded with the
    weights it is by: a run rewarding `last_number` is not judged by answer_correct's `#### N`."""
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens,
                              cfg.generation.max_new_tokens, temperature=1.0)
    problems = task.heldout(6)
    result = evaluate(engine, model.params, tok, problems, batch_size=8, num_examples=6,
                      rewards=RewardSet({"last_number": 2.0}))
    assert result.reward_weights == {"last_number": 2.0}
    by_hand = [last_number(e["completion"], e["answer"]) for e in result.examples]
    assert len(by_hand) == 6 and result.reward_components["last_number"] == pytest.approx(sum(by_hand) / 6)
    assert result.reward == pytest.approx(2.0 * sum(by_hand) / 6)
    assert scored_by(result.reward_weights) == "reward by task.rewards (last_number x2)"


def test_evaluation_scores_answers_through_the_bounded_reward_call():
    """The trainer's evaluation scored pass@k in its own process with no deadline; it calls answer_correct through
    `score_call` (a run's: the reward worker, whose overrun scores 0 as a sampler's does)."""
    import types

    from grpo_stream.common.episodes.evaluation import EvalResult, _sampled_figures
    asked = []

    def overran(name, fn, text, reference):  # a worker that killed every call at its deadline
        asked.append(name)
        return 0.0
    problems = [types.SimpleNamespace(prompt="q", answer="5")]
    result = EvalResult(0.0, 0.0, 1, 0.0, [])
    _sampled_figures(result, problems, [["#### 5", "#### 5"]], [1, 2], overran)
    assert result.pass_at_k == {"1": 0.0, "2": 0.0} and asked == ["answer_correct"] * 2  # once per completion
    _sampled_figures(result, problems, [["#### 5", "#### 5"]], [1, 2])  # no call: here, as before
    assert result.pass_at_k == {"1": 1.0, "2": 1.0} and result.maj_at_k == {"1": 1.0, "2": 1.0}


def test_a_problem_whose_prompt_has_no_tokens_is_skipped_and_counted_not_fatal(tiny_parts):
    """A prompt that encodes to no tokens was kept (only a long one was skipped) and the engine refused its request,
    failing the whole evaluation; a sampler skips such a prompt. Now it is skipped and counted here too."""
    import types

    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens, 4, temperature=1.0)
    problems = task.heldout(2)
    empty = types.SimpleNamespace(prompt="", answer="1", prompt_id="empty")
    assert tok.encode(empty.prompt) == []
    result = evaluate(engine, model.params, tok, [problems[0], empty, problems[1]], batch_size=4)
    assert (result.num_problems, result.skipped_empty_prompts, result.skipped_long_prompts) == (2, 1, 0)
