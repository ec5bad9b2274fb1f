"""A stop (SIGTERM) that comes during the warm start of a new run ends it there: the start neither evaluates
eval_before (which held the stop for a whole held-out evaluation, past up.stop_grace_s for a large one, and recorded
the figures of weights no run trains from: no step follows, no checkpoint keeps them) nor exports the warm-started
model."""

import threading

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service import core as core_module
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.core import TrainerCore
from grpo_stream.trainer_service.follower import ShardKeeper
from grpo_stream.trainer_service.model_parts import build_model_parts
from grpo_stream.trainer_service.plans import StartPlan
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from tests.conftest import CONFIGS
from tests.unit.trainer_service.test_trainer_core import SMALL_CORE


def test_a_stop_during_the_warm_start_skips_eval_before_and_the_export(tmp_path, monkeypatch):
    cfg = load_config(CONFIGS / "tiny_arith.yaml", [*SMALL_CORE, "warmstart.steps=3", "warmstart.batch_size=4"])
    stop = threading.Event()
    keeper = ShardKeeper(TrainerCheckpoints(str(tmp_path / "checkpoints"), 3, False), 0)
    core = TrainerCore(cfg, tmp_path, build_model_parts(cfg), WeightPublisher(), keeper, donate=True, warm_stop=stop)
    evaluated = []
    monkeypatch.setattr(core_module, "evaluate_heldout", lambda *args, **kwargs: evaluated.append(args[-1]))
    stop.set()  # SIGTERM while the warm start runs
    try:
        assert core.apply(StartPlan(epoch="e", restore=None, warm_start=True, export_warm=True,
                                    eval_before=True)) == 0
        assert evaluated == [] and core.carried["eval_before"] is None
        assert core.carried["warmstart"] is not None and not (tmp_path / "warmstart-model").exists()
    finally:
        keeper.checkpoints.close()
        core.close()
