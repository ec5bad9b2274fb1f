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
