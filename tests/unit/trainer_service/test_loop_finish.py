"""The end of a complete run: the trained model is exported (and a resumed complete run's final version published)
before eval_after, so an evaluation that fails, which fails the run and every restart of it, does not cost the
model the run trained."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service import core as core_module
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.core import TrainerCore
from grpo_stream.trainer_service.follower import ShardKeeper
from grpo_stream.trainer_service.model_parts import build_model_parts
from grpo_stream.trainer_service.plans import FinishPlan, StartPlan, StepPlan
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from tests.conftest import CONFIGS
from tests.unit.trainer_service.test_trainer_core import SMALL_CORE, batches


def test_a_failing_eval_after_fails_the_run_after_the_model_is_exported(tmp_path, monkeypatch):
    cfg = load_config(CONFIGS / "tiny_arith.yaml", [*SMALL_CORE, "trainer.eval_before=false", "trainer.steps=1"])
    keeper = ShardKeeper(TrainerCheckpoints(str(tmp_path / "checkpoints"), 3, False), 0)
    core = TrainerCore(cfg, tmp_path, build_model_parts(cfg), WeightPublisher(), keeper, donate=True)
    labels = []

    def out_of_memory(cfg, engine, params, task, tokenizer, label, progress=None):
        labels.append(label)
        raise RuntimeError(f"{label}: the evaluation engine ran out of device memory")

    monkeypatch.setattr(core_module, "evaluate_heldout", out_of_memory)
    try:
        core.apply(StartPlan(epoch="e", restore=None, warm_start=False, export_warm=False, eval_before=False))
        # unpublished, so that only the finish publishes version 1 (as a resumed, already complete run's does)
        core.apply(StepPlan(step=1, batch=batches(cfg, core.parts.tokenizer.vocab_size)[0], checkpoint=False,
                            publish=False, final=False))
        assert core.publisher.latest_version == 0
        with pytest.raises(RuntimeError, match="eval_after: the evaluation engine ran out of device memory"):
            core.apply(FinishPlan(steps=1, complete=True, checkpoint=False, publish=True, eval_after=True))
        assert labels == ["eval_after"]
        assert (tmp_path / "model" / "config.json").is_file() and list((tmp_path / "model").glob("*.safetensors"))
        assert core.publisher.latest_version == 1 and core.publisher.held(1).final
    finally:
        keeper.checkpoints.close()
        core.close(failed=True)
