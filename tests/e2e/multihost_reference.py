"""The single-process reference of a multi-process trainer run: replays the run's recorded batches.

    python -m tests.e2e.multihost_reference RUN_DIR

Run with XLA_FLAGS=--xla_force_host_platform_device_count=<the run's trainer.mesh devices>. Builds the run's model
from its config (same seed), warm-starts it as the trainer did, applies RUN_DIR/batches/step-*.npz in order with
one process holding the whole mesh, restores the run's newest checkpoint and prints JSON: the largest relative
difference of any parameter, and how far RL moved the parameters from where it started.
"""

import json
import pathlib
import sys

import numpy as np

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.core import TrainerCore
from grpo_stream.trainer_service.model_parts import build_model_parts
from grpo_stream.trainer_service.checkpoints.durability import updater_state
from grpo_stream.trainer_service.reports.metrics import MetricsWriter
from grpo_stream.trainer_service.plans import StartPlan, StepPlan
from grpo_stream.trainer_service.publication.publisher import WeightPublisher


class NoCheckpoints:
    """The reference keeps nothing: it only replays the batches."""

    def restore(self, step, updater):
        return None

    def begin_new_run(self):
        pass

    def save(self, step, updater, carried):
        raise AssertionError("the reference saves no checkpoint")

    def committed(self, wait=False, everything=False):
        pass


def main(run_dir: pathlib.Path, scratch: pathlib.Path) -> dict:
    cfg = load_config(run_dir / "config.yaml", ["trainer.processes=1", "trainer.record_batches=false"])
    core = TrainerCore(cfg, scratch, build_model_parts(cfg), WeightPublisher(), NoCheckpoints(), donate=False,
                       metrics=MetricsWriter(scratch, "reference"), writes_files=False)
    core.apply(StartPlan(epoch="reference", restore=None, warm_start=cfg.warmstart.steps > 0, export_warm=False,
                         eval_before=False))
    updater = core.updater
    start = core.model.to_named_numpy(updater.params)
    batches = sorted((run_dir / "batches").glob("step-*.npz"))
    for step, path in enumerate(batches, start=1):
        with np.load(path) as z:
            core.apply(StepPlan(step=step, batch=TrainBatch(**{k: z[k] for k in z.files}), checkpoint=False,
                                publish=False, final=False))
    core.wait_background()
    mine = core.model.to_named_numpy(updater.params)
    checkpoints = TrainerCheckpoints(str(run_dir / "checkpoints"), 3, False)
    restored = checkpoints.restore_latest(updater_state(updater))
    checkpoints.close()
    theirs = core.model.to_named_numpy(restored.state["params"])

    def rel(a, b):  # per tensor: the norm of the difference relative to the norm of the tensor
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
    return {"steps_replayed": len(batches), "checkpoint_step": restored.step,
            "max_rel_diff": max(rel(mine[n], theirs[n]) for n in mine),
            "max_abs_diff": max(float(np.abs(mine[n] - theirs[n]).max()) for n in mine),
            "rl_moved_rel": max(rel(mine[n], start[n]) for n in mine)}


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(main(pathlib.Path(sys.argv[1]), pathlib.Path(tmp))))
