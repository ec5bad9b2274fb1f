"""A `verifiers` environment, unchanged, trained on: `up` with task.name=verifiers on a tiny Qwen-family chat model
(tests/chat_families.py), the environment module tests/verifiers_envs/grpo_test_arith.py on PYTHONPATH. Its
rollouts call each sampler's OpenAI-compatible endpoint; groups are trained, the rubric's functions appear as reward
components in the metrics, the trainer's logprobs agree with the engine's on model tokens at lag 0, and the audit
finds every group accounted for. The multi-turn tool environment's episodes carry observation tokens (its tool or
reminder messages) that are not trained on."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.chat_families import chat_family_dirs  # noqa: F401 - a fixture
from tests.e2e.test_multi_turn_demo import audited, metrics
from tests.e2e.test_up import check_run, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ENVS = pathlib.Path(__file__).resolve().parents[1] / "verifiers_envs"
STEPS = 4


# both in `heavy` since stop 74 (45-66 s of a worker, CI time): the verifiers adapter's rollouts and evaluation over
# the real endpoint stay in the default lane (tests/integration/test_verifiers_eval.py)
@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["single", "tools"])
def test_a_verifiers_environment_trains_through_the_samplers_endpoint(tmp_path, chat_family_dirs, kind):  # noqa: F811
    pytest.importorskip("verifiers")
    run_dir = tmp_path / "run"
    proc = run_cli(
        "up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir), "model.kind=hf",
        f"model.path={chat_family_dirs['qwen']}", "model.dtype=float32", "task.name=verifiers",
        "task.verifiers.environment=grpo-test-arith", f"task.verifiers.args.kind={kind}",
        "generation.max_prompt_tokens=448", "generation.max_new_tokens=96", "environment.turn_max_new_tokens=16",
        "environment.tool_format=qwen", "generation.num_generations=4", "sampler.rows_in_flight=8", "sampler.replicas=1",
        f"trainer.steps={STEPS}", "trainer.groups_per_step=2", "warmstart.steps=0", "trainer.eval_before=false",
        "trainer.eval_after=false", "weights.verify_prompts=0", "checkpoint.every=2",
        timeout=900, env={"PYTHONPATH": str(ENVS)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=1, steps=STEPS)
    audited(run_dir)
    rows = [r for r in metrics(run_dir) if "train/reward/correct_answer" in r]
    assert len(rows) == STEPS and all("train/reward/brevity" in r for r in rows), rows[:1]
    agreement = summary["logprob_agreement_lag0"]
    assert agreement["tokens"] > 0 and agreement["mean_abs"] < 1e-5, agreement
    served = [s["openai"] for s in summary["samplers"].values()]
    assert all(s["sequences"] >= 4 for s in served), served
    fractions = [r["train/model_token_fraction"] for r in metrics(run_dir) if "train/model_token_fraction" in r]
    if kind == "tools":  # every episode had a second turn after the environment's message, continued token-exactly
        assert all(f < 0.95 for f in fractions), fractions
        assert all(s["chat_turns_continued"] >= 4 for s in served), served
    else:
        assert all(f == 1.0 for f in fractions), fractions
