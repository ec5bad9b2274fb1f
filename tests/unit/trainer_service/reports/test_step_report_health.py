"""The trainer's Prometheus gauges for off-policy health: set when a step's metrics have them, left alone when not."""

import types

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.reports.step_report import StepReporter

HEALTH = ("is_ess_group_mean", "mismatch_kl_k3", "is_truncated_fraction")


def reporter() -> StepReporter:
    cfg = load_config(None, ["trainer.metrics_port=null"])  # no HTTP server: the registry is read directly
    publisher = types.SimpleNamespace(latest_version=3, samplers=types.SimpleNamespace(installed={}))
    return StepReporter(cfg, metrics=None, buffer=None, publisher=publisher, held=lambda: 0)


def gauge(rep: StepReporter, name: str) -> float:
    return rep.prom.registry.get_sample_value(f"grpo_stream_{name}")


def base_row() -> dict:
    names = ("weight_version", "buffer_depth", "reward_mean", "accuracy", "staleness_mean", "step_seconds",
             "wait_seconds", "tokens_per_second", "groups_per_second", "compute_share")
    return dict.fromkeys(names, 1.0)


def test_health_gauges_follow_the_step_metrics_and_tolerate_their_absence():
    rep = reporter()
    rep._export(1, base_row(), {})  # a trainer that does not compute them yet: nothing fails, gauges untouched
    assert [gauge(rep, name) for name in HEALTH] == [0.0, 0.0, 0.0]
    rep._export(2, {**base_row(), "is_ess_group_mean": 0.8, "mismatch_kl_k3": 0.004, "is_truncated_fraction": 0.02},
                {})
    assert [gauge(rep, name) for name in HEALTH] == [0.8, 0.004, 0.02]
    assert gauge(rep, "trainer_step") == 2.0
