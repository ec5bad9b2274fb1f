"""The trainer's (and `grpo-stream eval`'s) evaluation runs a `verifiers` environment through the same rollout
interface as the samplers (issue 55): its rollouts call in-process OpenAI routes over the evaluating engine, their
model calls ride that engine's rollout stream (greedy ones beside sampled ones), and the rubric scores them; the
environment itself is the package's own, unchanged (tests/verifiers_envs/grpo_test_arith.py)."""

import pathlib
import sys

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.engine import continuous
from grpo_stream.common.episodes.evaluation import evaluate_run
from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from tests.chat_families import chat_family_dirs  # noqa: F401 - a fixture
from tests.conftest import CONFIGS

ENVS = pathlib.Path(__file__).resolve().parent.parent / "verifiers_envs"


@pytest.mark.parametrize("kind", ["single", "tools"])
def test_evaluation_runs_a_verifiers_environment_and_scores_it_by_its_rubric(chat_family_dirs, monkeypatch,  # noqa: F811
                                                                             kind):
    pytest.importorskip("verifiers")
    monkeypatch.syspath_prepend(str(ENVS))
    cfg = load_config(CONFIGS / "tiny_arith_smoke.yaml", [
        "model.kind=hf", f"model.path={chat_family_dirs['qwen']}", "model.dtype=float32", "task.name=verifiers",
        "task.verifiers.environment=grpo-test-arith", f"task.verifiers.args.kind={kind}",
        "generation.max_prompt_tokens=448", "generation.max_new_tokens=96", "environment.turn_max_new_tokens=16",
        "environment.tool_format=qwen", "generation.num_generations=4", "sampler.rows_in_flight=8",
        "eval.samples=2", "eval.ks=[1,2]", "eval.batch_size=8", "warmstart.steps=0"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tokenizer.vocab_size, seed=0)
    engine = continuous.build(cfg, model, tokenizer)
    problems = task.split_problems("train", 4)
    result = evaluate_run(cfg, engine, model.params, task, tokenizer, problems)
    assert result.num_problems == len(problems) == 4 and result.samples == 2
    # greedy, this random model stops at once: verifiers ends such rollouts with an error, which fails them (scored
    # 0, counted) without failing the evaluation
    assert result.failed_episodes >= 4 and result.reward == 0.0
    # sampled, it writes something: the rubric's two functions (and verifiers' own monitors) are the components, its
    # weighted sum the reward
    parts = result.sampled_reward_components
    assert {"correct_answer", "brevity"} <= set(parts), parts
    assert result.sampled_reward == pytest.approx(parts["correct_answer"] + 0.25 * parts["brevity"], abs=1e-6)
    assert result.sampled_reward > 0
    assert set(result.pass_at_k) == {"1", "2"} and all(0 <= v <= 1 for v in result.pass_at_k.values())
    assert engine.side is None  # the in-process routes were taken down with the evaluation
    assert "verifiers" in sys.modules
