"""The trainer's tokens/s and groups/s (StepReporter.rates): over a window of the steps reported, so a trainer
process's first step, which has no window yet, has no rate. It was reported as 0: the throughput plot fell to zero
at step 1 and at every resume, and the Prometheus gauge read 0 as if the trainer had stalled."""

import logging
import types

import numpy as np

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.buffer import BufferUnavailable
from grpo_stream.trainer_service.reports.step_report import MAIN_THREAD_PHASES, StepReporter
from tests.unit.trainer_service.reports.test_tracking import Recorder, group


class _DownBuffer:
    def counters(self):
        raise BufferUnavailable("Redis is away")


def reporter(metrics: Recorder) -> StepReporter:
    cfg = load_config(None, ["trainer.metrics_port=null", "logging.verbose=true"])  # no HTTP server; every line
    publisher = types.SimpleNamespace(latest_version=1, samplers=types.SimpleNamespace(installed={}))
    return StepReporter(cfg, metrics=metrics, buffer=_DownBuffer(), publisher=publisher, held=lambda: 0)


def report_step(rep: StepReporter, step: int, tokens: int, now: list[float], at: float) -> None:
    now[0] = at
    groups = [group(f"g{step}", "sampler-0", step - 1, [1.0, 0.0])]
    tokens_per_second, groups_per_second = rep.rates(tokens, len(groups))
    rep.report(step, groups, np.array([1]), {"reward_mean": 0.5}, {"loss": 0.1, "clip_fraction": 0.0},
               dict.fromkeys(MAIN_THREAD_PHASES, 0.25), tokens_per_second, groups_per_second)


def train_rows(metrics: Recorder) -> dict[int, dict]:
    return {call[1]: call[2] for call in metrics.calls if call[0] == "scalars" and call[3] == "train/"}


def test_the_first_step_of_a_trainer_process_has_no_rate_rather_than_zero(caplog, monkeypatch):
    metrics = Recorder()
    rep = reporter(metrics)
    now = [0.0]
    monkeypatch.setattr("grpo_stream.trainer_service.reports.step_report.time.time", lambda: now[0])
    with caplog.at_level(logging.INFO, logger="grpo_stream.trainer_service.reports.step_report"):
        report_step(rep, 1, tokens=400, now=now, at=100.0)
        report_step(rep, 2, tokens=500, now=now, at=110.0)
    rows = train_rows(metrics)
    assert "tokens_per_second" not in rows[1] and "groups_per_second" not in rows[1]
    assert rep.prom.registry.get_sample_value("grpo_stream_trainer_step") == 2.0
    # the second step's: its tokens over the 10 s since the first step was reported
    assert (rows[2]["tokens_per_second"], rows[2]["groups_per_second"]) == (50.0, 0.1)
    assert rep.prom.registry.get_sample_value("grpo_stream_tokens_per_second") == 50.0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[0].endswith("- tok/s") and lines[1].endswith(" 50 tok/s"), lines
