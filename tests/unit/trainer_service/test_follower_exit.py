"""A trainer process other than 0 ends at once on an error (process 0 would otherwise wait for it in a collective):
exit 1 for what a restart may fix, and for a permanent failure a record in RUN_DIR/failures and exit 3, so that
`up` stops the run instead of restarting the job into the same wall."""

import subprocess
import sys

import pytest

from grpo_stream.common.runtime.errors import EXIT_FAILURE, EXIT_PERMANENT, read_permanent

CODE = """
import pathlib, sys
from grpo_stream.trainer_service.checkpoints.errors import CheckpointMismatch
from grpo_stream.trainer_service.follower import stop_now
error = CheckpointMismatch("checkpoint.dir holds a different model") if sys.argv[2] == "permanent" else \\
    RuntimeError("lost trainer process 0")
stop_now(1, error, pathlib.Path(sys.argv[1]))
print("not reached")
"""


@pytest.mark.parametrize("kind, code", [("permanent", EXIT_PERMANENT), ("transient", EXIT_FAILURE)])
def test_a_follower_exits_at_once_with_the_code_up_acts_on(tmp_path, kind, code):
    proc = subprocess.run([sys.executable, "-c", CODE, str(tmp_path), kind], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code and "not reached" not in proc.stdout, proc.stderr[-2000:]
    record = read_permanent(tmp_path, "trainer-1")
    if kind == "permanent":
        assert record["message"] == "checkpoint.dir holds a different model"
    else:
        assert record is None


LEADER = """
import pathlib, sys, types
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service import loop
from grpo_stream.trainer_service.checkpoints.errors import CheckpointMismatch

class FailingTrainer:
    def __init__(self, cfg, run_dir, group):
        import threading
        self.stop_event = threading.Event()
    def run(self):
        raise CheckpointMismatch("checkpoint.dir holds a different model")

loop.start_group = lambda cfg: types.SimpleNamespace(leader=True)  # process 0 of a job of several
loop.Trainer = FailingTrainer
loop.run_trainer(load_config(None, []), pathlib.Path(sys.argv[1]))
print("not reached")
"""


def test_process_0_of_a_job_exits_at_once_too(tmp_path):
    """Process 0 failing while the others wait for its message: without os._exit, JAX's at-exit shutdown held it at
    a barrier for 5 minutes, then aborted (SIGABRT), and `up` saw a live job all that time."""
    proc = subprocess.run([sys.executable, "-c", LEADER, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_PERMANENT and "not reached" not in proc.stdout, proc.stderr[-2000:]
    assert read_permanent(tmp_path, "trainer-0")["message"] == "checkpoint.dir holds a different model"


FOLLOWER = """
import pathlib, sys, types
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.follower import run_follower

run_dir = pathlib.Path(sys.argv[1])
(run_dir / "not-a-dir").write_text("a file where checkpoint.dir points")
cfg = load_config(None, [f"checkpoint.dir={run_dir / 'not-a-dir'}"])
run_follower(cfg, run_dir, types.SimpleNamespace(index=1, leader=False))
print("not reached")
"""


def test_a_follower_whose_checkpoint_dir_is_unusable_exits_at_once_with_a_record(tmp_path):
    """checkpoint.dir unusable on one host only (a file in the way, a missing mount): the follower used to raise it
    past stop_now, so JAX's at-exit barrier held it for 5 minutes, then aborted, and `up` restarted the job into the
    same wall instead of stopping the run with the error."""
    proc = subprocess.run([sys.executable, "-c", FOLLOWER, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == EXIT_PERMANENT and "not reached" not in proc.stdout, proc.stderr[-2000:]
    assert "cannot be used as the checkpoint directory" in read_permanent(tmp_path, "trainer-1")["message"]
