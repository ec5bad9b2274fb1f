"""The last checkpoint's record holds the evaluations during RL that were still running when the last step ended:
a complete run started again (as `up` restarts a trainer that failed in eval_after) resumes from that record, and
before, it reported those versions as skipped and left them out of summary.json's curve, though they were evaluated."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service import core as core_module
from grpo_stream.trainer_service.plans import FinishPlan, StartPlan
from tests.conftest import CONFIGS
from tests.unit.trainer_service.test_core_eval_during import Evaluations, new_core, run_steps
from tests.unit.trainer_service.test_trainer_core import SMALL_CORE, STEPS, batches


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIGS / "tiny_arith.yaml", [
        *SMALL_CORE, "trainer.eval_before=false", "trainer.eval_after=true", "eval.every_steps=2",
        "checkpoint.every=2"])


def test_the_last_checkpoint_keeps_the_evaluations_that_ended_after_the_last_step(cfg, tmp_path, monkeypatch):
    real = core_module.evaluate_heldout

    def held_until_training_ends(cfg, engine, params, task, tokenizer, label, progress=None):
        # an evaluation slower than the steps after it: it ends only once its pauses are lifted (drain), which
        # happens when training is over
        assert progress.released.wait(120)
        return real(cfg, engine, params, task, tokenizer, label, progress=progress)

    monkeypatch.setattr(core_module, "evaluate_heldout", held_until_training_ends)
    core, keeper = new_core(cfg, tmp_path, Evaluations())
    data = batches(cfg, core.parts.tokenizer.vocab_size)
    core.apply(StartPlan(epoch="e1", restore=None, warm_start=False, export_warm=False, eval_before=False))
    run_steps(core, cfg, data, range(1, STEPS + 1))  # step 2 evaluated during RL; the last is eval_after's
    core.apply(FinishPlan(steps=STEPS, complete=True, checkpoint=False, publish=False, eval_after=False))
    core.close()
    keeper.checkpoints.close()
    assert [r["step"] for r in core.carried_now()["eval_curve"]] == [2]

    again, keeper = new_core(cfg, tmp_path, Evaluations())
    assert again.apply(StartPlan(epoch="e2", restore=STEPS, warm_start=False, export_warm=False,
                                 eval_before=False)) == STEPS
    state = again.carried_now()
    again.close()
    keeper.checkpoints.close()
    assert [r["step"] for r in state["eval_curve"]] == [2] and state["eval_skipped"] == []
