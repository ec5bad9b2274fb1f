"""The trainer's Prometheus series: the off-policy health gauges, set when a step's metrics have them and left alone
when not; the buffer's run-long counts as counters; the server stopped on close."""

import socket
import types

import pytest
from prometheus_client import generate_latest

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
    names = ("weight_version", "buffer_depth", "buffer_held", "reward_mean", "accuracy", "staleness_mean",
             "step_seconds", "wait_seconds", "tokens_per_second", "groups_per_second", "compute_share")
    return dict.fromkeys(names, 1.0)


def test_health_gauges_follow_the_step_metrics_and_tolerate_their_absence():
    rep = reporter()
    rep._export(1, base_row(), {})  # a trainer that does not compute them yet: nothing fails, gauges untouched
    assert [gauge(rep, name) for name in HEALTH] == [0.0, 0.0, 0.0]
    rep._export(2, {**base_row(), "is_ess_group_mean": 0.8, "mismatch_kl_k3": 0.004, "is_truncated_fraction": 0.02},
                {})
    assert [gauge(rep, name) for name in HEALTH] == [0.8, 0.004, 0.02]
    assert gauge(rep, "trainer_step") == 2.0


def test_the_buffers_counts_are_counters_named_total_and_the_depth_is_no_outcome():
    """The buffer's run-long counts (ingested, trained, dropped_*, refused_*) were one gauge, grpo_stream_groups,
    beside the stream's length as outcome="depth": counts typed gauge, without `_total`, against Prometheus'
    conventions, and a sum over outcomes that added a queue length to counts."""
    rep = reporter()
    rep._export(1, {**base_row(), "buffer_depth": 2.0, "buffer_held": 1.0},
                {"ingested": 10, "trained": 5, "dropped_stale": 2, "refused_full": 4, "depth": 3})
    text = generate_latest(rep.prom.registry).decode()
    assert "# TYPE grpo_stream_groups_total counter" in text
    assert "grpo_stream_groups{" not in text and 'outcome="depth"' not in text
    total = {outcome: rep.prom.registry.get_sample_value("grpo_stream_groups_total", {"outcome": outcome})
             for outcome in ("ingested", "trained", "dropped_stale", "refused_full")}
    assert total == {"ingested": 10.0, "trained": 5.0, "dropped_stale": 2.0, "refused_full": 4.0}
    assert (gauge(rep, "buffer_depth"), gauge(rep, "buffer_held")) == (2.0, 1.0)
    rep._export(2, base_row(), {"ingested": 12, "trained": 9, "dropped_stale": 2, "refused_full": 4, "depth": 1})
    assert rep.prom.registry.get_sample_value("grpo_stream_groups_total", {"outcome": "trained"}) == 9.0


class _FailingTrackers:
    def close(self, failed: bool = False) -> None:
        raise OSError(28, "No space left on device")


def test_the_metrics_server_stops_even_when_closing_the_trackers_fails():
    """StepReporter.close stopped /metrics only after the trackers closed: one that raised (a TensorBoard file on a
    full disk) left the server's thread and port behind in the process."""
    cfg = load_config(None, ["trainer.metrics_port=0", "trainer.metrics_host=127.0.0.1"])
    publisher = types.SimpleNamespace(latest_version=3, samplers=types.SimpleNamespace(installed={}))
    rep = StepReporter(cfg, metrics=_FailingTrackers(), buffer=None, publisher=publisher, held=lambda: 0)
    port = rep.prom.port
    with pytest.raises(OSError, match="No space left"):
        rep.close(failed=True)
    assert rep.prom._server is None
    with socket.socket() as probe:  # the port is free again
        probe.bind(("127.0.0.1", port))
