"""Loaded by every Python process started with this folder on PYTHONPATH (test_multihost_trainer.py): in trainer
process 1 only (JAX_PROCESS_ID=1) and only once per run (a marker file), TrainerCore.step raises at step
$FOLLOWER_FAULT_STEP, as a bug or a bad device would in the middle of a run."""

import os

_STEP, _MARKER = os.environ.get("FOLLOWER_FAULT_STEP"), os.environ.get("FOLLOWER_FAULT_MARKER")

if _STEP and _MARKER and os.environ.get("JAX_PROCESS_ID") == "1":
    from grpo_stream.trainer_service import core

    _original = core.TrainerCore.step

    def _step(self, plan):
        if plan.step == int(_STEP) and not os.path.exists(_MARKER):
            with open(_MARKER, "w") as marker:
                marker.write(str(os.getpid()))
            raise RuntimeError(f"injected fault: trainer process 1 fails at step {plan.step}")
        return _original(self, plan)

    core.TrainerCore.step = _step
