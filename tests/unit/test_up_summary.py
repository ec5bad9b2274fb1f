"""The end of `up` (grpo_stream/up/summary.py): its part of summary.json, which failure stopped the run, and its exit
code: 0 done, 1 a failure, 3 a permanent failure, 130 interrupted."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.up.supervise import Outcome
from grpo_stream.up.summary import RunEnd, RunSummary

TRAINER_SUMMARY = {"wall_seconds": 12.0, "steps": 4, "groups_ingested": 10, "groups_trained": 8,
                   "groups_dropped_stale": 1, "groups_dropped_invalid": 0, "groups_dropped_filtered": 0,
                   "groups_dropped_duplicate": 0, "groups_left_in_buffer": 1, "resumed_from": None}


def finish(tmp_path, outcome: Outcome, trainer_code: int | None = 0, sampler_codes=None, written: bool = True):
    if written:
        (tmp_path / "summary.json").write_text(json.dumps(TRAINER_SUMMARY))
    end = RunEnd(outcome, trainer_code, sampler_codes or {"sampler-0": 0}, {"trainer": 0, "sampler-0": 0},
                 tmp_path / "logs" / "trainer.log")
    code = RunSummary(load_config(None, []), tmp_path, started=0.0).finish(end)
    summary = json.loads((tmp_path / "summary.json").read_text()) if written else None
    return code, summary


def test_a_finished_run_completes_the_trainers_summary(tmp_path, capsys):
    code, summary = finish(tmp_path, Outcome("done"))
    assert code == 0 and summary["trainer_wall_seconds"] == 12.0 and summary["sampler_exit_codes"] == {"sampler-0": 0}
    assert "failure" not in summary and summary["restarts"] == {"trainer": 0, "sampler-0": 0}
    assert capsys.readouterr().out.startswith("[up] done in ")


def test_a_permanent_sampler_failure_is_in_the_summary_and_exits_3(tmp_path, capsys):
    code, summary = finish(tmp_path, Outcome("permanent", "sampler-0", "sampler.model differs"), 0, {"sampler-0": 3})
    assert code == 3
    assert summary["failure"] == {"process": "sampler-0", "kind": "permanent failure",
                                  "message": "sampler.model differs"}
    assert capsys.readouterr().err.strip() == "grpo-stream up: sampler-0 failed permanently: sampler.model differs"


def test_a_permanent_trainer_failure_leaves_no_summary_and_says_why(tmp_path, capsys):
    code, _ = finish(tmp_path, Outcome("permanent", "trainer", "a newer trainer took the run over"), 3, written=False)
    assert code == 3 and not (tmp_path / "summary.json").exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        "grpo-stream up: trainer failed permanently: a newer trainer took the run over"]


def test_a_sampler_that_gave_up_is_named_not_the_trainer_up_then_stopped(tmp_path, capsys):
    code, _ = finish(tmp_path, Outcome("gave_up", "sampler-0", "exited with code 1 (3 restarts in 60 s)"), -15,
                     {"sampler-0": 1}, written=False)
    err = capsys.readouterr().err
    assert code == 1 and "sampler-0 gave up: exited with code 1 (3 restarts in 60 s)" in err
    assert "trainer exited with code -15" not in err


def test_a_run_a_crash_loop_stopped_says_so_last_even_when_the_trainer_stopped_cleanly(tmp_path, capsys):
    """The trainer checkpointed and wrote its summary after `up` stopped the run for a sampler's crash loop: the
    last line was "[up] done in ...", with nothing on stderr, and the exit code 1 unexplained."""
    code, summary = finish(tmp_path, Outcome("gave_up", "sampler-1", "exited with code 1 (5 of ... restarts)"), 0,
                           {"sampler-0": 0, "sampler-1": 1})
    out, err = capsys.readouterr()
    assert code == 1 and summary["failure"]["process"] == "sampler-1" and out.startswith("[up] done in ")
    assert err.splitlines() == [f"grpo-stream up: sampler-1 gave up: exited with code 1 (5 of ... restarts); see "
                                f"{tmp_path / 'logs' / 'sampler-1.log'}"]


def test_the_embedded_redis_giving_up_points_at_its_own_log(tmp_path, capsys):
    code, _ = finish(tmp_path, Outcome("gave_up", "redis-server", "could not be started (...)"), 0)
    assert code == 1 and capsys.readouterr().err.strip().endswith(f"see {tmp_path / 'redis' / 'redis.log'}")


def test_a_finished_run_whose_sampler_failed_names_it(tmp_path, capsys):
    code, _ = finish(tmp_path, Outcome("done"), 0, {"sampler-0": 0, "sampler-1": -9})
    assert code == 1 and capsys.readouterr().err.splitlines() == [
        f"grpo-stream up: the trainer finished, but sampler-1 exited with code -9 (see "
        f"{tmp_path / 'logs' / 'sampler-1.log'})"]


@pytest.mark.parametrize("outcome, trainer_code, samplers, expected", [
    (Outcome("gave_up", "sampler-1", "exited with code 1 (...)"), 0, {"sampler-0": 0}, 1),  # crash loop, trainer ok
    (Outcome("done"), 0, {"sampler-0": 1}, 1),
    (Outcome("gave_up", "trainer", "exited with code -9"), -9, {"sampler-0": 0}, 1),  # not 247
    (Outcome("interrupted"), 0, {"sampler-0": 0}, 130),
])
def test_exit_codes(tmp_path, outcome, trainer_code, samplers, expected):
    code, _ = finish(tmp_path, outcome, trainer_code, samplers, written=trainer_code == 0)
    assert code == expected


def test_the_last_line_says_the_runs_own_reward_before_answer_correct(tmp_path, capsys):
    """A chat-form run rewarded by last_number: its held-out figure went 0.31 -> 0.72 while answer_correct (which
    reads `#### N`, never written in chat replies) went 0.016 -> 0.000; the last line says both, naming each."""
    evals = {key: {"accuracy": acc, "reward": reward, "reward_components": {"answer_correct": acc,
                                                                           "last_number": reward},
                   "reward_weights": {"last_number": 1.0}}
             for key, acc, reward in (("eval_before", 0.016, 0.31), ("eval_after", 0.0, 0.72))}
    (tmp_path / "summary.json").write_text(json.dumps({**TRAINER_SUMMARY, **evals}))
    end = RunEnd(Outcome("done"), 0, {"sampler-0": 0}, {"trainer": 0}, tmp_path / "trainer.log")
    RunSummary(load_config(None, []), tmp_path, started=0.0).finish(end)
    line = capsys.readouterr().out
    assert ("held-out greedy reward by task.rewards (last_number x1) 0.310 -> 0.720 (last_number 0.310 -> 0.720); "
            "greedy accuracy 0.016 -> 0.000;") in line, line


def test_groups_generated_counts_this_runs_samplers_and_never_falls_below_the_trainers_count(tmp_path):
    """Each sampler-<i>.json holds its last process's count: a sampler restarted after 100 groups writes 60, which
    the trainer (that adds up the processes) knows as 160. A file of an earlier `up` here with more replicas (or a
    sampler that did not write this time) is not this run's."""
    (tmp_path / "sampler-1.json").write_text(json.dumps({"groups_generated": 999}))  # an earlier, wider run
    os.utime(tmp_path / "sampler-1.json", (1.0, 1.0))
    (tmp_path / "sampler-0.json").write_text(json.dumps({"groups_generated": 60}))
    (tmp_path / "summary.json").write_text(json.dumps({**TRAINER_SUMMARY, "groups_generated": 160}))
    end = RunEnd(Outcome("done"), 0, {"sampler-0": 0}, {"trainer": 0, "sampler-0": 1}, tmp_path / "logs" / "t.log")
    cfg = load_config(None, ["sampler.replicas=2"])
    RunSummary(cfg, tmp_path, started=1000.0).finish(end)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["samplers"]) == {"sampler-0"} and summary["groups_generated"] == 160



def test_a_sampler_file_cut_short_is_named_and_the_rest_of_the_summary_is_written(tmp_path, capsys):
    """`up` stops a sampler still running FINISH_S after the trainer finished; one killed while writing its
    sampler-<i>.json left it cut short, and `up` ended in a JSONDecodeError traceback after a finished run, without
    its part of summary.json. Now the file is named (samplers_damaged, a warning), the other samplers' reports are
    kept, and groups_generated stays the trainer's count (the damaged file's is unknown)."""
    (tmp_path / "sampler-0.json").write_text(json.dumps({"groups_generated": 60}))
    (tmp_path / "sampler-1.json").write_text('{"sampler_id": "sampler-1", "groups_gen')
    (tmp_path / "summary.json").write_text(json.dumps({**TRAINER_SUMMARY, "groups_generated": 160}))
    end = RunEnd(Outcome("done"), 0, {"sampler-0": 0, "sampler-1": -9}, {"trainer": 0}, tmp_path / "logs" / "t.log")
    code = RunSummary(load_config(None, ["sampler.replicas=2"]), tmp_path, started=0.0).finish(end)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 1 and summary["samplers"] == {"sampler-0": {"groups_generated": 60}}
    assert summary["samplers_damaged"] == ["sampler-1"] and summary["groups_generated"] == 160
    assert summary["trainer_wall_seconds"] == 12.0
    assert f"{tmp_path / 'sampler-1.json'}: not JSON" in capsys.readouterr().err

GONE_READER = """
import json, os, pathlib, sys
from grpo_stream.common.config.loading import load_config
from grpo_stream.up.relay import QueuedConsole
from grpo_stream.up.summary import RunEnd, RunSummary
from grpo_stream.up.supervise import Outcome
run_dir, part = pathlib.Path(sys.argv[1]), sys.argv[2]
read, write = os.pipe()
os.close(read)  # `up | head` after head exited, or `up | tee` with tee killed
os.dup2(write, 1)
code = 0
if part == "console":  # the children's lines while they run
    console = QueuedConsole()
    for i in range(3):
        console.write(f"[sampler-0] line {i}\\n")
    console.drain()
else:  # up's last line
    end = RunEnd(Outcome("done"), 0, {"sampler-0": 0}, {"trainer": 0}, run_dir / "logs" / "trainer.log")
    code = RunSummary(load_config(None, []), run_dir, started=0.0).finish(end)
sys.stderr.write(f"returned {code}\\n")
sys.exit(code)
"""


@pytest.mark.parametrize("part", ["console", "summary"])
def test_a_console_reader_gone_does_not_fail_a_finished_run(tmp_path, part):
    """`up | tee log` with tee killed during the run (or `up | head`): the run went on (the console's thread gives
    up on it), but the last line, printed straight to the dead pipe, raised BrokenPipeError: a run that completed
    exited 1 with "error: [Errno 32] Broken pipe"; and the lines the console's thread left in stdout's buffer made
    Python's own flush at shutdown fail: exit 120."""
    (tmp_path / "summary.json").write_text(json.dumps(TRAINER_SUMMARY))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a user's shell: stdout buffered
    proc = subprocess.run([sys.executable, "-c", GONE_READER, str(tmp_path), part], capture_output=True, text=True,
                          timeout=120, cwd=pathlib.Path(__file__).resolve().parents[2], env=env)
    assert proc.returncode == 0 and proc.stderr == "returned 0\n", proc.stderr


def test_a_run_stopped_while_the_trainer_was_starting_says_it_was_stopped_not_that_the_trainer_failed(tmp_path,
                                                                                                    capsys):
    """A SIGTERM to `up` while its trainer was still importing killed the trainer (its handler was not in place
    yet): `up` exited 130 but its last line read "trainer exited with code -15", a failure to chase."""
    code, _ = finish(tmp_path, Outcome("interrupted"), -15, {"sampler-0": 0}, written=False)
    err = capsys.readouterr().err
    assert code == 130 and err.startswith("grpo-stream up: stopped by a signal before the trainer wrote its summary")
    assert "trainer exit code -15" in err and f"on {tmp_path} to resume" in err
