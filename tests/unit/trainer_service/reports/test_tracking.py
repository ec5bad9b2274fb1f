"""The tracker interface (trainer_service/reports/metrics.py): the fan-out hands every record to every backend, the file
backends keep the files and keys runs always had, sample tables and final figures are built from what the trainer
holds, and wandb stays unimported unless tracking.wandb.enabled."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.reports.metrics import FanOut, MetricsWriter, Tracker, final_figures, sample_rows
from tests.e2e.test_up import ROOT, tensorboard_tags


class Recorder(Tracker):
    """An in-memory backend: every call, in order."""

    def __init__(self, wants: int = 0, fail_close: bool = False):
        self.calls, self.wants, self.fail_close = [], wants, fail_close

    def scalars(self, step, values, prefix="", jsonl=True):
        self.calls.append(("scalars", step, values, prefix, jsonl))

    def histogram(self, step, name, values):
        self.calls.append(("histogram", step, name, list(values)))

    def samplers(self, step, figures):
        self.calls.append(("samplers", step, figures))

    def config(self, resolved):
        self.calls.append(("config", resolved))

    def samples_wanted(self, step):
        return self.wants

    def samples(self, step, rows):
        self.calls.append(("samples", step, rows))

    def summary(self, values):
        self.calls.append(("summary", values))

    def close(self, failed=False):
        self.calls.append(("close", failed))
        if self.fail_close:
            raise OSError("disk full")


def test_the_fan_out_hands_every_record_to_every_backend_in_order():
    a, b = Recorder(wants=0), Recorder(wants=5)
    fan = FanOut([a, b])
    fan.config({"trainer": {"steps": 3}})
    fan.scalars(1, {"loss": 0.5}, prefix="train/", jsonl=False)
    fan.histogram(1, "train/staleness", [0, 1])
    fan.samplers(1, {"sampler-0": {"weight_lag": 1}})
    fan.samples(1, [{"prompt": "Q"}])
    fan.summary({"steps": 1})
    fan.close(failed=True)
    expected = [("config", {"trainer": {"steps": 3}}), ("scalars", 1, {"loss": 0.5}, "train/", False),
                ("histogram", 1, "train/staleness", [0, 1]), ("samplers", 1, {"sampler-0": {"weight_lag": 1}}),
                ("samples", 1, [{"prompt": "Q"}]), ("summary", {"steps": 1}), ("close", True)]
    assert a.calls == b.calls == expected
    assert fan.samples_wanted(1) == 5  # the most any backend wants
    assert FanOut([]).samples_wanted(1) == 0 and Tracker().samples_wanted(1) == 0


def test_the_fan_out_closes_every_backend_when_one_fails_then_raises():
    failing, after = Recorder(fail_close=True), Recorder()
    with pytest.raises(OSError, match="disk full"):
        FanOut([failing, after]).close()
    assert after.calls == [("close", False)]


class Unreachable(Recorder):
    """A remote backend that stops taking records (W&B's service gone)."""

    def scalars(self, step, values, prefix="", jsonl=True):
        raise ConnectionError("service gone")


def test_an_optional_backend_that_fails_is_dropped_and_the_others_keep_every_record():
    files, remote = Recorder(), Unreachable()
    fan = FanOut([files, remote], optional=[remote])
    fan.scalars(1, {"loss": 0.5})
    fan.scalars(2, {"loss": 0.4})
    fan.summary({"steps": 2})
    assert [c[1] for c in files.calls if c[0] == "scalars"] == [1, 2] and ("summary", {"steps": 2}) in files.calls
    assert fan.backends == [files] and remote.calls == []
    # a required backend's failure (the run's own files) still fails the step
    with pytest.raises(ConnectionError):
        FanOut([Unreachable()]).scalars(1, {"loss": 0.5})


def test_an_optional_backend_that_fails_to_close_does_not_fail_a_run_that_ended():
    """W&B's close raising (its service gone) made a finished trainer exit 1, and `up` restart a complete run."""
    files, remote = Recorder(), Recorder(fail_close=True)
    FanOut([remote, files], optional=[remote]).close()
    assert files.calls == [("close", False)]


def test_the_metrics_writer_keeps_the_files_and_keys_runs_always_had(tmp_path):
    writer = MetricsWriter(tmp_path, "trainer")
    writer.scalars(1, {"loss": 0.25, "reward_mean": 1}, prefix="train/")
    writer.scalars(1, {"quiet": 3.0}, prefix="other/", jsonl=False)
    writer.histogram(1, "train/staleness", np.array([0, 1, 1]))
    writer.samplers(1, {"sampler-0": {"weight_lag": 2}, "sampler-1": {"weight_lag": 0}})
    writer.config({"run": {"name": "x"}})  # no place for these in the files: dropped
    writer.samples(1, [{"prompt": "Q"}])
    writer.summary({"steps": 1})
    assert writer.samples_wanted(1) == 0  # nothing there keeps sample text: the reporter detokenizes nothing
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics-trainer.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 1 and isinstance(rows[0]["time"], float)
    assert {k: v for k, v in rows[0].items() if k not in ("step", "time")} == {"train/loss": 0.25,
                                                                               "train/reward_mean": 1.0}
    assert tensorboard_tags(tmp_path / "tb" / "trainer") == {
        "train/loss": "scalar", "train/reward_mean": "scalar", "other/quiet": "scalar",
        "train/staleness": "histogram", "sampler_weight_lag/sampler-0": "scalar",
        "sampler_weight_lag/sampler-1": "scalar"}
    assert {p.name for p in tmp_path.iterdir()} == {"tb", "metrics-trainer.jsonl"}


def group(gid: str, sampler: str, version: int, rewards, prompt=(5, 6)) -> GroupData:
    completions = [CompletionData(np.array([7, k], np.int32), np.zeros(2, np.float32), r, k == 0)
                   for k, r in enumerate(rewards)]
    return GroupData(gid, gid, np.array(prompt, np.int32), completions, version, sampler)


def test_sample_rows_take_whole_groups_in_order_up_to_the_cap_as_text():
    groups = [group("g0", "sampler-0", 3, [1.0, 0.0, 0.5]), group("g1", "sampler-1", 2, [0.0, 1.0, 1.0])]
    rows = sample_rows(groups, np.array([1, 2]), max_rows=4, decode=lambda ids: "|".join(f"t{i}" for i in ids))
    assert [(r["group_id"], r["reward"]) for r in rows] == [("g0", 1.0), ("g0", 0.0), ("g0", 0.5), ("g1", 0.0)]
    assert rows[3] == {"group_id": "g1", "sampler": "sampler-1", "version": 2, "staleness": 2, "prompt": "t5|t6",
                       "completion": "t7|t0", "reward": 0.0, "truncated": True}
    # without a tokenizer the table still shows what was sampled: the token ids
    assert sample_rows(groups, [1, 2], max_rows=1)[0]["completion"] == "7 0"
    assert len(sample_rows(groups, [1, 2], max_rows=100)) == 6
    # a client's injected prompt and its completions stay out of the tables unless asked for
    groups[0].injected = True
    assert [r["group_id"] for r in sample_rows(groups, [1, 2], max_rows=100)] == ["g1"] * 3
    assert len(sample_rows(groups, [1, 2], max_rows=100, injected=True)) == 6


def test_final_figures_add_each_samplers_figures_from_what_this_trainer_knows_and_its_fresh_reports(tmp_path):
    stale = tmp_path / "sampler-1.json"  # a previous run's report in the same run directory
    stale.write_text(json.dumps({"groups": 99}))
    os.utime(stale, (time.time() - 3600,) * 2)
    (tmp_path / "sampler-0.json").write_text(json.dumps({"groups": 12, "tokens_generated": 340, "final_weights": None,
                                                         "versions": [0, 2], "drained": True}))
    summary = {"steps": 4, "groups_by_sampler": {"sampler-0": 12, "sampler-1": 9},
               "sampler_weight_versions": {"sampler-0": [0, 2, 4], "sampler-1": []}}
    figures = final_figures(summary, tmp_path, since=time.time() - 60)
    assert {k: v for k, v in figures.items() if k not in summary} == {
        "sampler/sampler-0/groups_ingested": 12, "sampler/sampler-1/groups_ingested": 9,
        "sampler/sampler-0/last_installed_version": 4, "sampler/sampler-0/groups": 12,
        "sampler/sampler-0/tokens_generated": 340}
    assert all(figures[k] == v for k, v in summary.items())


def test_the_trainer_never_imports_wandb_when_tracking_is_off(tmp_path):
    """The trainer's modules, its trackers opened and used with the default config: wandb (an optional extra, and
    a second of start-up) is not in sys.modules."""
    code = ("import pathlib, sys\n"
            "import grpo_stream.trainer_service.loop, grpo_stream.trainer_service.follower\n"
            "import grpo_stream.up.colocated\n"
            "from grpo_stream.common.config.loading import load_config\n"
            "from grpo_stream.trainer_service.reports.metrics import open_trackers\n"
            "trackers = open_trackers(load_config(None), pathlib.Path(sys.argv[1]))\n"
            "trackers.scalars(1, {'loss': 1.0}, prefix='train/'); trackers.summary({'steps': 1}); trackers.close()\n"
            "assert len(trackers.backends) == 2, trackers.backends\n"
            "print(sorted(m for m in sys.modules if m == 'wandb' or m.startswith('wandb.')))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
