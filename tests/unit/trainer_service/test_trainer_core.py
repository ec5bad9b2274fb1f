"""TrainerCore driven by scripted plans, as every trainer process drives it: a new run, steps with and without a
checkpoint or a publication, the end; then a second core restoring the checkpoint. Its parameters are those of the
plain update loop the trainer ran before the core existed (a PolicyUpdater on the same batches), and a process
told to restore a step its checkpoint directory lacks stops at the start with a message instead of training."""

import threading

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.packing import packing_layout
from grpo_stream.trainer_service.checkpoints.store import CheckpointDisagreement, TrainerCheckpoints
from grpo_stream.trainer_service.core import CoreHooks, TrainerCore
from grpo_stream.trainer_service.model_parts import build_model_parts
from grpo_stream.trainer_service.follower import ShardKeeper
from grpo_stream.trainer_service.plans import DonePlan, FinishPlan, StartPlan, StepPlan
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from tests.conftest import CONFIGS

STEPS = 4


# a one-layer demo model, 2 groups of 4 a step, no warm start and no weight verification: the cores of these tests
SMALL_CORE = ["model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.head_dim=8",
              "model.tiny.num_layers=1", "generation.num_generations=4", "generation.max_new_tokens=8",
              "warmstart.steps=0", "eval.num_problems=4", "eval.batch_size=4", "trainer.groups_per_step=2",
              f"trainer.steps={STEPS}", "weights.verify_prompts=0"]


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIGS / "tiny_arith.yaml", [*SMALL_CORE, "trainer.eval_before=false",
                                                     "trainer.eval_after=false"])


def batches(cfg, vocab: int):
    """STEPS batches of two groups each, completions of random tokens with rewards that differ within a group."""
    rng = np.random.default_rng(0)
    gen = cfg.generation
    out = []
    for step in range(STEPS):
        groups = []
        for k in range(2):
            comps = [CompletionData(rng.integers(3, vocab, 6).astype(np.int32), np.full(6, -2.0, np.float32),
                                    float(j % 2), False) for j in range(gen.num_generations)]
            groups.append(GroupData(f"g{step}-{k}", f"p{k}", rng.integers(3, vocab, 5).astype(np.int32), comps,
                                    step, "s"))
        out.append(build_batch(groups, gen.max_prompt_tokens, gen.max_new_tokens, 0, cfg.algo,
                               held_version=step)[0])
    return out


class Recorded(CoreHooks):
    def __init__(self):
        self.trained_steps, self.reported = [], []

    def trained(self, plan, metrics):
        self.trained_steps.append(plan.step)

    def report(self, plan, metrics, phases):
        self.reported.append((plan.step, plan.publish))


def new_core(cfg, tmp_path, hooks=None):
    parts = build_model_parts(cfg)
    keeper = ShardKeeper(TrainerCheckpoints(str(tmp_path / "checkpoints"), 3, False), 0)
    return TrainerCore(cfg, tmp_path, parts, WeightPublisher(), keeper, donate=True, hooks=hooks,
                       writes_files=False), keeper


def step(n, batch, checkpoint=False, publish=False):
    return StepPlan(step=n, batch=batch, checkpoint=checkpoint, publish=publish, final=n == STEPS)


def test_scripted_plans_train_as_the_plain_update_loop_and_resume_from_the_checkpoint(cfg, tmp_path):
    hooks = Recorded()
    core, keeper = new_core(cfg, tmp_path, hooks)
    data = batches(cfg, core.parts.tokenizer.vocab_size)
    start = StartPlan(epoch="e1", restore=None, warm_start=False, export_warm=False, eval_before=False)
    assert core.apply(start) == 0 and core.publisher.latest_version == 0
    # the reference: the plain loop over the same batches, from the same initial parameters
    t, model = cfg.trainer, build_model_parts(cfg).model
    reference = PolicyUpdater(model.with_remat(t.remat), model.params, cfg.algo, t.learning_rate, t.max_grad_norm,
                              cfg.generation.temperature, 0, packing_layout(cfg, 1, model.arch), core.parts.mesh,
                              t.optimizer, t.steps, donate=False)
    for n, batch in enumerate(data, start=1):
        core.apply(step(n, batch, checkpoint=n == 2, publish=n % 2 == 0))
        reference.update(batch)
    assert core.apply(FinishPlan(steps=STEPS, complete=True, checkpoint=True, publish=False,
                                 eval_after=False)) is None
    assert core.apply(DonePlan(verify=0)) is None
    mine, theirs = core.model.to_named_numpy(core.params), model.to_named_numpy(reference.params)
    assert all(np.array_equal(mine[name], theirs[name]) for name in mine)
    assert hooks.trained_steps == [1, 2, 3, 4] and hooks.reported == [(1, False), (2, True), (3, False), (4, True)]
    assert core.publisher.latest_version == STEPS
    keeper.checkpoints.close()
    core.close()

    # a second core restores step 2 (what process 0 chose) and trains steps 3 and 4 again: the same parameters
    again, keeper = new_core(cfg, tmp_path)
    assert again.apply(StartPlan(epoch="e2", restore=2, warm_start=False, export_warm=False, eval_before=False)) == 2
    for n in (3, 4):
        again.apply(step(n, data[n - 1]))
    again.wait_background()
    resumed = again.model.to_named_numpy(again.params)
    assert all(np.array_equal(resumed[name], mine[name]) for name in mine)
    keeper.checkpoints.close()
    again.close()


def test_a_process_told_to_restore_a_step_it_does_not_hold_stops_at_the_start(cfg, tmp_path):
    core, keeper = new_core(cfg, tmp_path)
    with pytest.raises(CheckpointDisagreement, match="does not hold the checkpoint of step 7, which trainer "
                                                     "process 0 chose"):
        core.apply(StartPlan(epoch="e", restore=7, warm_start=False, export_warm=False, eval_before=False))
    assert core.updater.params is not None and core.publisher.latest_version is None  # nothing was published
    keeper.checkpoints.close()
    core.close()


class TrainedStep(CoreHooks):
    def __init__(self, step: int):
        self.step, self.event = step, threading.Event()

    def trained(self, plan, metrics):
        if plan.step == self.step:
            self.event.set()


@pytest.mark.parametrize("copy", [True, False])
def test_a_slow_publication_holds_the_next_update_only_without_weights_publish_copy(cfg, tmp_path, copy):
    """A donating update overwrites the parameters a publication reads: with weights.publish_copy the publication
    reads a copy and the next update runs at once (its step then waits at the hand-off: publications are at most one
    step behind); without, the update waits until the publication is done. Either way the version published holds
    its own step's weights, not the next one's."""
    second = TrainedStep(2)
    core, keeper = new_core(cfg.model_copy(update={"weights": cfg.weights.model_copy(update={"publish_copy": copy})}),
                            tmp_path, second)
    data = batches(cfg, core.parts.tokenizer.vocab_size)
    core.apply(StartPlan(epoch="e", restore=None, warm_start=False, export_warm=False, eval_before=False))
    entered, release, inner = threading.Event(), threading.Event(), core.publisher.sink.put

    def slow_put(version, named, *args, **kwargs):
        if version == 1:
            entered.set()
            assert release.wait(120)
        return inner(version, named, *args, **kwargs)

    core.publisher.sink.put = slow_put
    core.apply(step(1, data[0], publish=True))
    step_one = core.model.to_named_numpy(core.params)
    assert entered.wait(60)
    next_step = threading.Thread(target=core.apply, args=(step(2, data[1]),))
    next_step.start()
    # step 2's update is done (its groups are being recorded) while publication 1 is held, only with the copy
    assert second.event.wait(60 if copy else 3) is copy
    release.set()
    next_step.join(timeout=60)
    assert not next_step.is_alive()
    core.wait_background()  # step 2's books too
    assert second.event.is_set()
    published = core.publisher.held(1).arrays
    assert core.publisher.latest_version == 1 and set(published) == set(step_one)
    assert all(np.array_equal(published[name], step_one[name]) for name in step_one)
    step_two = core.model.to_named_numpy(core.params)
    assert any(not np.array_equal(step_two[name], step_one[name]) for name in step_one)  # step 2 did train
    keeper.checkpoints.close()
    core.close()


def test_a_stop_before_the_first_step_does_not_claim_a_checkpoint(cfg, tmp_path, caplog):
    """Stopped during the warm start or eval_before, the trainer said "stopped at step 0 with a checkpoint; start the
    trainer again to resume" with checkpoints/ empty: none is saved before step 1, and a new start warm-starts again."""
    core, keeper = new_core(cfg, tmp_path)
    core.apply(StartPlan(epoch="e1", restore=None, warm_start=False, export_warm=False, eval_before=False))
    with caplog.at_level("INFO", logger="grpo_stream.trainer_service.core"):
        core.apply(FinishPlan(steps=0, complete=False, checkpoint=False, publish=False, eval_after=False))
    keeper.checkpoints.close()
    core.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopped at step 0")]
    assert said == ["stopped at step 0 before the first RL step, with nothing to keep: a new start begins the run "
                    "again"]
    assert not list((tmp_path / "checkpoints").glob("[0-9]*"))
