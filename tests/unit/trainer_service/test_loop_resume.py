"""What a resumed trainer takes from the checkpoint it restores besides the weights, and what it refuses there:

- a checkpoint past trainer.steps (the setting lowered since it was saved) is refused at the start, before anything
  is published, naming the setting: resumed there, the run used to train nothing, export nothing, never publish the
  final version that tells samplers to stop, and report itself stopped (to be resumed) at every start;
- process 0's run-long counts (groups_trained_mixed_versions) ride in each checkpoint's record and a resumed trainer
  goes on from them: its summary used to count only the groups it trained itself, as if they were the whole run's."""

import types

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.checkpoints.errors import RunRefused
from grpo_stream.trainer_service.core import CoreHooks
from grpo_stream.trainer_service.plan_sources import LeaderSource, _StepContext
from grpo_stream.trainer_service.plans import StartPlan, step_plan
from tests.conftest import CONFIGS
from tests.unit.trainer_service.test_core_eval_during import new_core
from tests.unit.trainer_service.test_trainer_core import SMALL_CORE, batches

MIXED_SO_FAR = 3


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIGS / "tiny_arith.yaml", [*SMALL_CORE, "trainer.eval_before=false",
                                                    "trainer.eval_after=false", "checkpoint.every=2"])


class Counting(CoreHooks):
    """Hooks with a run-long count, as process 0's LeaderSource has."""

    def __init__(self, count=0):
        self.count, self.records = count, []

    def carried(self):
        return {"groups_trained_mixed_versions": self.count}

    def restored(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def checkpointed(cfg, tmp_path_factory):
    """A run directory whose checkpoint of step 2 was saved with hooks counting MIXED_SO_FAR."""
    run_dir = tmp_path_factory.mktemp("run")
    core, keeper = new_core(cfg, run_dir, Counting(MIXED_SO_FAR))
    data = batches(cfg, core.parts.tokenizer.vocab_size)
    core.apply(StartPlan(epoch="e1", restore=None, warm_start=False, export_warm=False, eval_before=False))
    for n in (1, 2):
        core.apply(step_plan(cfg, n, data[n - 1]))
    core.wait_background()
    keeper.checkpoints.close()
    core.close()
    return run_dir


def start(restore):
    return StartPlan(epoch="e2", restore=restore, warm_start=False, export_warm=False, eval_before=False)


def with_steps(cfg, steps):
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"steps": steps})})


def test_a_checkpoint_past_trainer_steps_is_refused_before_anything_is_published(cfg, checkpointed):
    core, keeper = new_core(with_steps(cfg, 1), checkpointed, Counting())
    try:
        with pytest.raises(RunRefused, match=r"checkpoint resumed is of RL step 2, past trainer.steps=1.*"
                                             r"Set trainer.steps=2 to end it there"):
            core.apply(start(2))
        assert core.publisher.latest_version is None
    finally:
        keeper.checkpoints.close()
        core.close()


def test_the_hooks_counts_ride_in_the_checkpoint_and_come_back_on_resume(cfg, checkpointed):
    hooks = Counting()
    # at the configured end exactly (a complete run started again) it resumes as before
    core, keeper = new_core(with_steps(cfg, 2), checkpointed, hooks)
    try:
        assert core.apply(start(2)) == 2 and core.publisher.latest_version == 2
    finally:
        keeper.checkpoints.close()
        core.close()
    assert [r["groups_trained_mixed_versions"] for r in hooks.records] == [MIXED_SO_FAR]


def group(i: int, versions: list[int]) -> GroupData:
    comps = [CompletionData(np.array([3] * len(versions), np.int32), np.zeros(len(versions), np.float32), float(j),
                            False, versions=np.array(versions, np.int64)) for j in range(2)]
    return GroupData(f"g{i}", f"p{i}", np.array([1, 2], np.int32), comps, min(versions), "s", data_position=i)


def test_process_0_counts_mixed_version_groups_as_trained_and_goes_on_from_its_checkpoint(cfg):
    services = types.SimpleNamespace(durability=types.SimpleNamespace(trained=lambda step, picked: None))
    metrics = {"update_tokens_real": 4, "update_tokens_laid_out": 8, "fresh_tokens": 0}
    source = LeaderSource(cfg, None, services)
    source.restored({"groups_trained_mixed_versions": MIXED_SO_FAR})
    picked = [(None, group(0, [1, 1, 2])), (None, group(1, [2, 2, 2])), (None, group(2, [0, 1, 2]))]
    source._context[3] = _StepContext(picked, np.zeros(3), {}, 0.0, {})
    source.trained(types.SimpleNamespace(step=3), metrics)
    assert source.carried() == {"groups_trained_mixed_versions": MIXED_SO_FAR + 2}
    source.restored({})  # a checkpoint written before the count was kept
    assert source.mixed_version_groups == 0
