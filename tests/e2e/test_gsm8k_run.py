"""The whole loop on real GSM8K data with the tiny model on CPU: prompts from the train split, sharded over two
samplers, scored by the GSM8K rewards, evaluated on the test split."""

import json

import pytest

from tests.e2e.test_up import check_run, run_cli

# 46 s of a worker: GSM8K's loading, prompts and rewards are checked on the real data in the default lane
# (tests/unit/common/tasks); `up` on it with SmolLM2 is the realmodel lane's
pytestmark = [pytest.mark.e2e, pytest.mark.heavy]


def test_up_on_gsm8k_with_the_tiny_model(tmp_path, gsm8k_dir):
    run_dir = tmp_path / "run"
    overrides = ["task.name=gsm8k", f"task.dataset.source={gsm8k_dir}", "task.dataset.limit=400", "warmstart.steps=0",
                 "model.tiny.vocab_size=1024", "generation.max_prompt_tokens=128", "generation.max_new_tokens=16",
                 "trainer.steps=4", "eval.num_problems=16", "eval.batch_size=16",
                 "task.rewards={answer_correct: 1.0, answer_format: 0.1}"]
    proc = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir), *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=2, steps=4)
    after = summary["eval_after"]
    # prompts longer than generation.max_prompt_tokens are counted, not scored
    assert after["num_problems"] + after["skipped_long_prompts"] == 16 and after["num_problems"] >= 8
    # prompts came from the GSM8K train split: the trainer's logged examples are GSM8K questions
    assert summary["eval_after"]["examples"][0]["prompt"].startswith("Q: Janet")  # test/0 of GSM8K
    ev = run_cli("eval", "--config", "configs/tiny_arith_smoke.yaml", "--json", str(tmp_path / "e.json"), *overrides,
                 "model.kind=hf", f"model.path={run_dir / 'model'}", timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["accuracy"] == after["accuracy"] and result["examples"] == after["examples"]
