"""A stop (SIGTERM) that comes while a one-process trainer runs eval_before or eval_after ends that evaluation at its
next progress call: a whole held-out evaluation (eval.num_problems, 256 by default) held the stop past up.stop_grace_s,
so `up` killed the trainer before it wrote summary.json. The run still ends as a stop should: a new run's start
publishes version 0 and keeps nothing (the next start evaluates again); a complete run is exported, its final version
published, and its summary has no eval_after (a start again resumes the complete run and evaluates it)."""

import threading

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


def stopped_midway(stop: threading.Event, labels: list):
    """evaluate_heldout's stand-in: calls `progress` as each of 50 groups ends (`labels`: the label and the groups
    it got through), and SIGTERM comes after the second group."""

    def evaluate(cfg, engine, params, task, tokenizer, label, progress=None):
        labels.append(label)
        for group in range(50):
            progress()
            labels.append(group)
            if group == 1:
                stop.set()
        return {"accuracy": 1.0}

    return evaluate


def new_core(tmp_path, stop, *extra):
    cfg = load_config(CONFIGS / "tiny_arith.yaml", [*SMALL_CORE, "trainer.steps=1", *extra])
    keeper = ShardKeeper(TrainerCheckpoints(str(tmp_path / "checkpoints"), 3, False), 0)
    core = TrainerCore(cfg, tmp_path, build_model_parts(cfg), WeightPublisher(), keeper, donate=True, warm_stop=stop)
    beats = []
    core.progress = lambda: beats.append(1)  # drive's heartbeat
    return cfg, core, keeper, beats


def test_a_stop_during_eval_before_ends_it_and_the_start_keeps_nothing(tmp_path, monkeypatch):
    stop, labels = threading.Event(), []
    _, core, keeper, beats = new_core(tmp_path, stop)
    monkeypatch.setattr(core_module, "evaluate_heldout", stopped_midway(stop, labels))
    try:
        assert core.apply(StartPlan(epoch="e", restore=None, warm_start=False, export_warm=False,
                                    eval_before=True)) == 0
        assert labels == ["eval_before", 0, 1] and beats  # ended at the progress call after the stop, beating
        assert core.carried["eval_before"] is None and core.publisher.latest_version == 0
    finally:
        keeper.checkpoints.close()
        core.close()


def test_a_stop_during_eval_after_ends_it_after_the_export_and_the_final_version(tmp_path, monkeypatch):
    stop, labels = threading.Event(), []
    cfg, core, keeper, _ = new_core(tmp_path, stop, "trainer.eval_before=false")
    monkeypatch.setattr(core_module, "evaluate_heldout", stopped_midway(stop, labels))
    try:
        core.apply(StartPlan(epoch="e", restore=None, warm_start=False, export_warm=False, eval_before=False))
        core.apply(StepPlan(step=1, batch=batches(cfg, core.parts.tokenizer.vocab_size)[0], checkpoint=True,
                            publish=True, final=True))
        assert core.apply(FinishPlan(steps=1, complete=True, checkpoint=False, publish=False, eval_after=True)) is None
        assert labels == ["eval_after", 0, 1]
        assert (tmp_path / "model" / "config.json").is_file() and core.publisher.held(1).final
        # a stop that came before it: not started at all
        assert core.apply(FinishPlan(steps=1, complete=True, checkpoint=False, publish=False, eval_after=True)) is None
        assert labels == ["eval_after", 0, 1]
    finally:
        keeper.checkpoints.close()
        core.close()
