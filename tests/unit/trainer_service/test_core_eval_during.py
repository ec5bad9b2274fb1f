"""TrainerCore with eval.every_steps: the weights of every due step are evaluated in the background and reported at
that step (its version), the curve rides in the checkpoints, and a resumed core evaluates again a due step whose
evaluation was lost (the last one too, when eval_after does not evaluate it), then goes on at the next due steps."""

import shutil

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.core import CoreHooks, TrainerCore
from grpo_stream.trainer_service.model_parts import build_model_parts
from grpo_stream.trainer_service.follower import ShardKeeper
from grpo_stream.trainer_service.plans import FinishPlan, StartPlan, step_plan
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from tests.conftest import CONFIGS
from tests.unit.trainer_service.test_trainer_core import SMALL_CORE, STEPS, batches


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIGS / "tiny_arith.yaml", [
        *SMALL_CORE, "trainer.eval_before=true", "trainer.eval_after=false", "eval.samples=2", "eval.ks=[1,2]",
        "eval.every_steps=2", "checkpoint.every=2"])


class Evaluations(CoreHooks):
    def __init__(self):
        self.rows = []

    def evaluated(self, step, values):
        self.rows.append((step, values))


class CarryingKeeper(ShardKeeper):
    """Process 0's keeper as far as the records go: what the core carries is in each checkpoint's record."""

    def save(self, step, updater, carried):
        from grpo_stream.trainer_service.checkpoints.durability import updater_state  # noqa: PLC0415

        self.checkpoints.save(step, updater_state(updater), {"process": 0, **carried})


def new_core(cfg, tmp_path, hooks):
    keeper = CarryingKeeper(TrainerCheckpoints(str(tmp_path / "checkpoints"), 3, False), 0)
    return TrainerCore(cfg, tmp_path, build_model_parts(cfg), WeightPublisher(), keeper, donate=True, hooks=hooks,
                       writes_files=False), keeper


def run_steps(core, cfg, data, steps):
    for n in steps:
        core.apply(step_plan(cfg, n, data[n - 1]))


def test_due_steps_are_evaluated_reported_carried_and_resumed(cfg, tmp_path):
    hooks = Evaluations()
    core, keeper = new_core(cfg, tmp_path, hooks)
    data = batches(cfg, core.parts.tokenizer.vocab_size)
    core.apply(StartPlan(epoch="e1", restore=None, warm_start=False, export_warm=False, eval_before=True))
    run_steps(core, cfg, data, [1, 2, 3])
    assert core.evaluator.drain(120)  # so checkpoint 4's record holds step 2's evaluation
    run_steps(core, cfg, data, [4])
    core.apply(FinishPlan(steps=STEPS, complete=True, checkpoint=False, publish=False, eval_after=False))
    core.close()
    keeper.checkpoints.close()
    assert [s for s, _ in hooks.rows] == [0, 2, 4]  # eval_before at 0, then every 2 steps (the last: no eval_after)
    for s, values in hooks.rows:
        assert values["version"] == s and 0.0 <= values["accuracy"] <= 1.0 and values["num_problems"] == 4
        assert {"pass_at_1", "pass_at_2", "maj_at_1", "maj_at_2", "reward", "reward/answer_correct"} <= set(values)
    assert all(values["errors"] == 0 and values["skipped"] == 0 for s, values in hooks.rows if s)
    state = core.carried_now()
    assert [r["step"] for r in state["eval_curve"]] == [2, 4] and state["eval_errors"] == 0

    # resumed from step 2, whose checkpoint was saved before its evaluation ended: step 2 is evaluated again, then 4
    # (the trainer died before checkpoint 4 was written: a checkpoint newer than the one restored is never there)
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    hooks = Evaluations()
    again, keeper = new_core(cfg, tmp_path, hooks)
    assert again.apply(StartPlan(epoch="e2", restore=2, warm_start=False, export_warm=False, eval_before=True)) == 2
    run_steps(again, cfg, data, [3])
    assert again.evaluator.drain(120)  # so this run's checkpoint 4 holds step 2's evaluation (read below)
    run_steps(again, cfg, data, [4])
    again.apply(FinishPlan(steps=STEPS, complete=True, checkpoint=False, publish=False, eval_after=False))
    again.close()
    keeper.checkpoints.close()
    assert [s for s, _ in hooks.rows] == [2, 4]
    assert [r["step"] for r in again.carried_now()["eval_curve"]] == [2, 4]

    # resumed from step 4, the last (a complete run started again, as `up` restarts a trainer that failed after its
    # final checkpoint): the curve comes back from its record, and step 4, due (eval_after is off) and saved before
    # its evaluation ended, is evaluated again rather than missing from the summary's curve
    hooks = Evaluations()
    done, keeper = new_core(cfg, tmp_path, hooks)
    assert done.apply(StartPlan(epoch="e3", restore=4, warm_start=False, export_warm=False, eval_before=True)) == 4
    done.apply(FinishPlan(steps=STEPS, complete=True, checkpoint=False, publish=False, eval_after=False))
    done.close()
    keeper.checkpoints.close()
    assert [s for s, _ in hooks.rows] == [4]
    assert [r["step"] for r in done.carried_now()["eval_curve"]] == [2, 4]

    # with eval_after on, the last step's weights are eval_after's: a complete run resumed evaluates them there only
    hooks = Evaluations()
    after = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"eval_after": True})})
    done, keeper = new_core(after, tmp_path, hooks)
    assert done.apply(StartPlan(epoch="e4", restore=4, warm_start=False, export_warm=False, eval_before=True)) == 4
    assert done.evaluator.pending() == []
    done.close()
    keeper.checkpoints.close()

    # resumed with eval.every_steps=0: no evaluator, and the curve its checkpoint holds still rides in the next
    # checkpoints and the summary (it was replaced by an empty one); step 4's point ended after checkpoint 4 was saved
    off = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"every_steps": 0})})
    done, keeper = new_core(off, tmp_path, Evaluations())
    assert done.apply(StartPlan(epoch="e5", restore=4, warm_start=False, export_warm=False, eval_before=True)) == 4
    assert done.evaluator is None and [r["step"] for r in done.carried_now()["eval_curve"]] == [2]
    done.close()
    keeper.checkpoints.close()
