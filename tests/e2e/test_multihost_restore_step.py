"""Issue 41, finding 8: the checkpoint step a two-process trainer resumes from is process 0's choice, for every
process. Before, each process walked the steps itself: trainer process 1, unable to read the newest checkpoint
(step 4) where process 0 could, restored step 2 while process 0 restored step 4 (Orbax's restore barriers still
paired up), and the collectives then ran on shards of two different steps.

A one-process trainer writes checkpoints 2 and 4 against a real Redis; then the two JAX processes start as `up`
starts them (python -m grpo_stream trainer, JAX_COORDINATOR_ADDRESS ...), process 1 given a view of the checkpoint
directory in which step 4's record is damaged. Process 1 must stop with an error naming the step process 0 chose,
and neither may restore step 2. With the same view as process 0 both then resume from step 4 and finish the run.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from grpo_stream.common.config.loading import to_yaml
from grpo_stream.common.rollouts.redis_server import free_port
from grpo_stream.trainer_service.control_messages import SECRET_ENV, new_secret
from grpo_stream.trainer_service.loop import Trainer
from tests.e2e.test_up import ROOT
from tests.integration.test_trainer_resume import config, fill, groups  # noqa: F401 - `groups` is a fixture
from tests.support import stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]
# tiny_arith.yaml evaluates during the run, which one trainer process does alone (the config refuses it for two)
TWO_PROCESSES = ["trainer.processes=2", "trainer.mesh.fsdp=4", "trainer.steps=6", "eval.every_steps=0"]


def view_with_damaged_record(checkpoints: pathlib.Path, view: pathlib.Path, step: int) -> None:
    """`view`: the checkpoints as another host might see them, every step a link to the real one except `step`, a
    copy whose record does not parse."""
    view.mkdir()
    for entry in checkpoints.iterdir():
        if entry.name == str(step):
            shutil.copytree(entry, view / entry.name)
            (view / entry.name / "record" / "metadata").write_text("{")
        else:
            (view / entry.name).symlink_to(entry)


def start_job(config_file: pathlib.Path, run_dir: pathlib.Path, checkpoint_dirs: list[pathlib.Path]):
    """The two trainer processes, as `up` starts them; each with its own checkpoint.dir."""
    coordinator, secret = f"127.0.0.1:{free_port()}", new_secret()
    return [subprocess.Popen(
        [sys.executable, "-m", "grpo_stream", "trainer", "--config", str(config_file), "--run-dir", str(run_dir),
         *TWO_PROCESSES, f"checkpoint.dir={checkpoint_dirs[k]}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
             "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(k),
             "GRPO_STREAM_ADVERTISE_HOST": "127.0.0.1", SECRET_ENV: secret}) for k in range(2)]


@pytest.mark.chaos  # restarts of a 2-process trainer (70 s), beside the chaos lane's other multi-host faults
def test_every_process_restores_the_step_process_0_chose_or_the_job_stops(groups, shared_redis, run_name,  # noqa: F811
                                                                          tmp_path):
    fill(shared_redis.url, run_name, groups)
    cfg = config(shared_redis.url, run_name, **{"trainer.steps": 4})
    Trainer(cfg, tmp_path).run()  # checkpoints of steps 2 and 4
    checkpoints, view = tmp_path / "checkpoints", tmp_path / "view-of-process-1"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]
    view_with_damaged_record(checkpoints, view, 4)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(to_yaml(cfg))

    leader, follower = start_job(config_file, tmp_path, [checkpoints, view])
    try:
        follower_out, _ = follower.communicate(timeout=300)
    finally:
        stop_process(leader, grace_s=5)  # as `up` stops the job when one of its processes failed
        stop_process(follower, grace_s=5)
    leader_out = leader.communicate()[0]
    assert follower.returncode not in (0, None), follower_out[-4000:]
    assert ("trainer process 1 cannot read the checkpoint of step 4" in follower_out
            and "which trainer process 0 chose for every process" in follower_out), follower_out[-4000:]
    assert "checkpoint of step 2" not in follower_out + leader_out  # never the step before: never mixed
    assert (checkpoints / "4").is_dir(), leader_out[-6000:]  # process 0 could read it: not set aside

    leader, follower = start_job(config_file, tmp_path, [checkpoints, checkpoints])
    try:
        outputs = [p.communicate(timeout=300)[0] for p in (leader, follower)]
    finally:
        stop_process(leader, grace_s=5)
        stop_process(follower, grace_s=5)
    assert leader.returncode == 0 and follower.returncode == 0, outputs[0][-3000:] + outputs[1][-3000:]
    for out in outputs:
        assert "resuming from the checkpoint of step 4" in out, out[-3000:]
    assert "trainer process 1 done at step 6" in outputs[1]
