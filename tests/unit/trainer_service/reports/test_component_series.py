"""The train/reward/<name> series: one per reward component, at most MAX_COMPONENT_SERIES in a run (component names
come from samplers; one sending new names every group would grow the metrics file and TensorBoard without bound)."""

import logging
import types

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.reports.step_report import MAX_COMPONENT_SERIES, StepReporter, component_means


def groups_with(*components: dict) -> list:
    return [types.SimpleNamespace(completions=[types.SimpleNamespace(reward_components=c) for c in components])]


def test_every_component_has_its_own_series_up_to_the_bound_and_the_rest_share_one():
    kept: set[str] = set()
    first = component_means(groups_with({"a": 1.0, "b": 0.0}, {"a": 0.0}), kept, max_series=3)
    assert first == {"reward/a": 0.5, "reward/b": 0.0} and kept == {"a", "b"}
    later = component_means(groups_with({"c": 1.0, "d": 2.0, "e": 4.0}, {"a": 1.0}), kept, max_series=3)
    # c takes the last place; d and e (names past the bound) are folded into one series: their mean
    assert later == {"reward/(other)": 3.0, "reward/a": 1.0, "reward/c": 1.0} and kept == {"a", "b", "c"}


def test_a_sampler_inventing_names_every_step_does_not_grow_the_series(caplog):
    cfg = load_config(None, ["trainer.metrics_port=null"])  # no HTTP server
    publisher = types.SimpleNamespace(latest_version=0, samplers=types.SimpleNamespace(installed={}))
    reporter = StepReporter(cfg, metrics=None, buffer=None, publisher=publisher, held=lambda: 0)
    series: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="grpo_stream.trainer_service.reports.step_report"):
        for step in range(10):
            names = {f"step{step}_metric{i}": float(i) for i in range(20)}
            series |= set(reporter._component_means(groups_with(names, {"answer_correct": 1.0})))
    assert len(series) == MAX_COMPONENT_SERIES + 1 and "reward/(other)" in series
    assert "reward/answer_correct" in series  # named in the first step: kept for the run
    warnings = [r.getMessage() for r in caplog.records if "folded" in r.getMessage()]
    assert len(warnings) == 1 and "train/reward/(other)" in warnings[0]
