"""Issue 58: the real pretrained model's CPU demo learns through the whole loop. SmolLM2-135M-Instruct, built from its
wheel by the `smollm2_dir` fixture (`grpo-stream fixture smollm2`), runs configs/smollm2_arith.yaml as shipped under
`up` (trainer and sampler processes, Redis, gRPC): held-out greedy reward by the run's own `task.rewards`
(last_number: the last number of the reply) must rise by the bar below, and `audit` must account for every group.
Lane `realmodel`; about 6 minutes on an idle 2-core machine.

The bar comes from repeated runs of the same command (`python -m grpo_stream.bench.learning_spread smollm2 --runs 10
--out tests/e2e/calibration/smollm2-arith.json`, then more with --runs 4 on the same file; the module's doc says
how): see the constant."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_multi_turn_demo import audited
from tests.e2e.test_up import check_run, run_cli

pytestmark = [pytest.mark.realmodel, pytest.mark.e2e, pytest.mark.slow]
CONFIG = "configs/smollm2_arith.yaml"
# The bar (calibration/smollm2-arith.json, 2026-11-29, 14 runs of the shipped config on a 2-core AMD machine, idle but
# for two short test runs at low priority beside runs 1 and 2; 328-367 s each): held-out greedy reward 0.148 before
# every run (greedy and the same problems: deterministic on one machine), gain 0.133-0.305, mean 0.229, sd 0.063; this
# test's own first run (the same command, between runs 10 and 11) gained 0.102. The bar is the 99% one-sided lower
# prediction bound for one more run, mean - t(0.99, n - 1) x sd x sqrt(1 + 1/n): 0.056 over the 14 runs, 0.033 with
# the test's run as a 15th; the lower, rounded down to 0.03 (4 of the 128 problems): a healthy run falls below it with
# probability about 1% or less, if the gain is normal. The answer_correct accuracy stays near 0 (0-0.023): the model
# states its answer in prose ("... so Mia found 88 + 44 = 132 books."), not as "#### 132", which is why the run is
# scored by last_number.
MIN_REWARD_GAIN = 0.03


def test_smollm2_learns_additions_by_its_reward_through_the_whole_loop(tmp_path, smollm2_dir):
    run_dir = tmp_path / "run"
    proc = run_cli("up", "--config", CONFIG, "--run-dir", str(run_dir), f"model.path={smollm2_dir}", timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=1, steps=summary["steps"])
    print(audited(run_dir))
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["reward_weights"] == after["reward_weights"] == {"last_number": 1.0}  # scored by the run's reward
    gain = after["reward"] - before["reward"]
    print(f"smollm2 demo: held-out greedy reward {before['reward']:.3f} -> {after['reward']:.3f} "
          f"({after['num_problems']} problems), wall {summary['wall_seconds']}s")
    assert gain >= MIN_REWARD_GAIN, (before, after)
