"""The W&B backend for real: wandb (and its wandb-core service process) writes an offline run, which the test reads
back from the run's .wandb transaction log (tests/wandb_offline.py). Offline mode: nothing goes to the network."""

import socket
import sys
import threading

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.redact import redacted
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.trainer_service.reports.metrics import open_trackers, sample_rows
from grpo_stream.trainer_service.reports.wandb_tracker import SAMPLE_COLUMNS, SAMPLES_KEY, WandbTracker
from tests.unit.trainer_service.reports.test_tracking import group
from tests.wandb_offline import offline_runs, read_run

OFFLINE = ["tracking.wandb.enabled=true", "tracking.wandb.mode=offline", "tracking.wandb.project=grpo-stream-test",
           "run.name=wb-test"]


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's own settings, cache and artifact staging in the test's directory, not the user's home."""
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path


def test_an_offline_run_holds_the_config_every_family_of_scalars_the_sample_tables_and_the_summary(wandb_home,
                                                                                                    monkeypatch):
    overrides = [*OFFLINE, "tracking.wandb.samples_every=2", "tracking.wandb.samples_max_rows=4",
                 "task.verifiers.args.api_key=sk-live-secret", "sampler.vllm.engine_args.hf_token=hf_secret"]
    cfg = load_config(None, overrides)
    # as `up` and compose start the trainer: every override on its command line, which W&B's metadata would keep
    monkeypatch.setattr(sys, "argv", [sys.argv[0], "trainer", *overrides])
    run_dir = wandb_home / "run"
    trackers = open_trackers(cfg, run_dir)
    trackers.scalars(10, {"loss": 2.0}, prefix="warmstart/")  # warm-start steps count from 1 like RL steps
    groups = [group("g0", "sampler-0", 1, [1.0, 0.0, 0.0]), group("g1", "sampler-1", 0, [0.0, 0.0, 1.0])]
    tables = {}
    for step in range(1, 5):
        trackers.scalars(step, {"loss": 1.0 / step, "reward_mean": 0.25 * step}, prefix="train/")
        trackers.histogram(step, "train/staleness", np.array([0, 1]))
        trackers.samplers(step, {"sampler-0": {"weight_lag": step % 2}, "sampler-1": {"weight_lag": 0}})
        if trackers.samples_wanted(step):
            tables[step] = sample_rows(groups, [0, 1], trackers.samples_wanted(step), lambda ids: f"<{len(ids)}>")
            trackers.samples(step, tables[step])
    trackers.summary({"steps": 4, "groups_trained": 16, "eval_after": {"accuracy": 0.5}})
    trackers.close()

    (directory,) = offline_runs(run_dir)  # tracking.wandb.dir null: under the run directory
    assert list(directory.glob("run-*.wandb")) and (run_dir / "metrics-trainer.jsonl").exists()
    run = read_run(directory)
    assert {k: run.run[k] for k in ("project", "group", "name", "exit_code")} == {
        "project": "grpo-stream-test", "group": "wb-test", "name": "wb-test", "exit_code": 0}
    resolved = redacted(cfg.model_dump(mode="json"))  # an environment's API key never reaches W&B
    assert {k: run.config[k] for k in resolved} == resolved
    assert run.config["task"]["verifiers"]["args"]["api_key"] == "<redacted>"
    assert "secret" not in b"".join(p.read_bytes() for p in directory.rglob("*") if p.is_file()).decode("latin-1")
    assert [(r["train/step"], r["train/loss"]) for r in run.history if "train/loss" in r] == [
        (s, pytest.approx(1.0 / s)) for s in range(1, 5)]
    assert run.column("warmstart/loss") == [2.0] and run.column("warmstart/step") == [10]
    assert [r["train/staleness"]["_type"] for r in run.history if "train/staleness" in r] == ["histogram"] * 4
    lags = [(r["sampler/step"], r["sampler/sampler-0/weight_lag"]) for r in run.history if "sampler/step" in r]
    assert lags == [(1, 1), (2, 0), (3, 1), (4, 0)]
    logged = [(r["samples/step"], r[SAMPLES_KEY]) for r in run.history if SAMPLES_KEY in r]
    assert [step for step, _ in logged] == [2, 4]  # every tracking.wandb.samples_every steps
    for step, value in logged:
        rows = run.table(value)
        assert len(rows) == 4 and list(rows[0]) == list(SAMPLE_COLUMNS)
        assert rows == [{**row, "step": step} for row in tables[step]]
    assert rows[0]["prompt"] == "<2>" and rows[3]["group_id"] == "g1"
    assert run.summary["steps"] == 4 and run.summary["eval_after"] == {"accuracy": 0.5}
    assert run.summary["train/loss"] == pytest.approx(0.25)  # and W&B's own last values


def test_a_failed_run_ends_its_wandb_run_with_a_nonzero_exit_code(wandb_home):
    trackers = open_trackers(load_config(None, [*OFFLINE, "tracking.wandb.samples_every=0"]), wandb_home / "run")
    assert trackers.samples_wanted(50) == 0  # samples_every=0: never a table
    trackers.scalars(1, {"loss": 1.0}, prefix="train/")
    trackers.close(failed=True)
    (directory,) = offline_runs(wandb_home / "run")
    assert read_run(directory).run["exit_code"] == 1


def test_wandb_missing_from_the_environment_is_a_permanent_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where the extra is not installed
    with pytest.raises(PermanentError, match=r"pip install 'grpo-stream\[wandb\]'.*tracking.wandb.enabled=false"):
        WandbTracker(load_config(None, OFFLINE), tmp_path)



def test_a_wandb_dir_that_cannot_be_made_is_a_permanent_error_naming_the_setting(tmp_path):
    """tracking.wandb.dir under a regular file (or anywhere unwritable) raised a bare NotADirectoryError naming
    neither the setting nor the fix, of a transient kind: `up` restarted the trainer into the same error."""
    (tmp_path / "afile").write_text("x")
    cfg = load_config(None, [*OFFLINE, f"tracking.wandb.dir={tmp_path / 'afile' / 'wandb'}"])
    with pytest.raises(PermanentError, match=r"tracking.wandb.dir=.*afile/wandb: cannot make .*Not a directory"):
        WandbTracker(cfg, tmp_path / "run")

def test_an_online_run_whose_server_does_not_answer_is_logged_offline_instead(wandb_home, monkeypatch, caplog):
    """Online W&B with no route to its server (no network, W&B down) blocked the trainer's start for W&B's
    init_timeout and then raised CommError, which is no transient kind: `up` stopped the whole run (exit 3) over a
    copy of figures the run's own files keep. Now the trainer goes on, recording an offline run for `wandb sync`."""
    with socket.socket() as s:  # a local port nobody listens on: refused at once, no network needed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    import wandb  # noqa: PLC0415 - only the W&B tests need it
    from wandb.analytics.opentelemetry import opentelemetry_proxy  # noqa: PLC0415 - as above

    wandb.teardown()  # W&B reads its environment once per setup: an earlier test's would keep the 90 s default
    # W&B's own usage analytics off for this test: online, they build OpenTelemetry providers whose fork handlers
    # start threads in a forked child, and a later test of this worker that starts a process with a preexec_fn
    # (`up`'s children) saw it die of SIGSEGV or SIGBUS between fork and exec (two CI runs, 2026-12-01)
    disabled = threading.Event()
    disabled.set()
    monkeypatch.setattr(opentelemetry_proxy, "_disabled", disabled)
    online = [o for o in OFFLINE if o != "tracking.wandb.mode=offline"]
    trackers = open_trackers(load_config(None, [*online, "tracking.wandb.samples_every=0"]), wandb_home / "run")
    trackers.scalars(1, {"loss": 1.0}, prefix="train/")
    trackers.close()
    assert "wandb sync" in caplog.text
    (directory,) = offline_runs(wandb_home / "run")
    assert read_run(directory).column("train/loss") == [1.0]
