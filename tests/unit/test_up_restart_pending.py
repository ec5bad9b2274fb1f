"""A process that failed within its restart budget and waits out its back-off when the trainer finishes: the run
finished, and the failure was being healed, so `up` exits 0. It exited 1 ("the trainer finished, but sampler-0
exited with code 1"), or 0 when the restart came a moment earlier: the exit code of a finished run depended on when
a preempted sampler's back-off ended. Real child processes, `up`'s own loop (run._run_processes)."""

from __future__ import annotations

import json
import pathlib
import sys

from grpo_stream.common.config.loading import load_config
from grpo_stream.up import run as up_run
from grpo_stream.up.processes import ProcessSpec
from grpo_stream.up.summary import RunSummary
from tests.unit.test_up_summary import TRAINER_SUMMARY

# the trainer: waits until `up` has decided to restart the crashed sampler (the test's file GO), then writes its
# summary and exits 0, as a trainer that reached its last step
TRAINER = ("import pathlib, sys, time\nrun = pathlib.Path(sys.argv[1])\n"
           "while not (run / 'GO').exists():\n    time.sleep(0.02)\n"
           "(run / 'summary.json').write_text(sys.argv[2])\n")


def test_a_finished_run_whose_sampler_waits_for_its_restart_exits_0(tmp_path, monkeypatch):
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if line.startswith("[up] sampler-0 exited with code 1; restarting it in"):
            (tmp_path / "GO").touch()
    monkeypatch.setattr(up_run, "_say", say)
    (tmp_path / "logs").mkdir()
    cfg = load_config(None, ["up.restart_backoff_s=600", "up.restart_backoff_max_s=600"])
    specs = [ProcessSpec("trainer", (sys.executable, "-c", TRAINER, str(tmp_path), json.dumps(TRAINER_SUMMARY)),
                         {}, "trainer", "trainer-0"),
             ProcessSpec("sampler-0", (sys.executable, "-c", "import sys; sys.exit(1)"), {}, "sampler", "sampler-0")]
    end = up_run._run_processes(cfg, tmp_path, specs, None)
    assert end.outcome.reason == "done" and end.sampler_codes == {"sampler-0": 1}, (end, said)
    code = RunSummary(cfg, pathlib.Path(tmp_path), started=0.0).finish(end)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0, said
    assert summary["samplers_restart_pending"] == ["sampler-0"] and summary["sampler_exit_codes"] == {"sampler-0": 1}
