"""What a trainer step reports: a console line (at a readable cadence), TensorBoard scalars and histograms, a
metrics-trainer.jsonl row, and the Prometheus series."""

from __future__ import annotations

import logging
import time

import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.rollouts.buffer import BufferUnavailable, RolloutBuffer
from grpo_stream.common.runtime.prometheus import OTHER, BoundedGauge, ServiceMetrics, bounded_series
from grpo_stream.trainer_service.learning.batching import without_signal
from grpo_stream.trainer_service.reports.metrics import Tracker, sample_rows

log = logging.getLogger(__name__)
MAX_LAG_SERIES = 64  # sampler_weight_lag series (at least sampler.replicas); the rest share one
# reward/<name> series a run keeps: component names come from samplers (a rubric's metrics, any reward's name), and a
# buggy or hostile one sending new names every group would grow the metrics file and TensorBoard without bound. At
# least the MAX_REWARD_COMPONENTS one completion may carry, so one completion's set always fits.
MAX_COMPONENT_SERIES = 64

_GAUGES = (("trainer_step", "RL steps completed"), ("weight_version", "latest published weight version"),
           ("buffer_depth", "groups waiting in the buffer to be trained"),
           ("buffer_held", "groups trained but not yet acknowledged: held in the buffer until the next checkpoint"),
           ("reward_mean", "mean reward of the last batch"),
           ("accuracy", "answer accuracy of the last batch"), ("staleness_mean", "mean staleness of the last batch"),
           ("step_seconds", "wall time of the last step"),
           ("wait_seconds", "time the last step's main thread waited for its plan (its data)"),
           ("tokens_per_second", "completion tokens trained per second over the last window"),
           ("groups_per_second", "rollout groups trained per second over the last window"),
           ("compute_share", "share of the last step's wall time spent in the jitted update"))
# off-policy health (learning/off_policy_health.py), exported when the step's metrics have them
_HEALTH_GAUGES = (("is_ess_group_mean", "per-group sequence importance-weight ESS of the last batch, in (0, 1]"),
                  ("mismatch_kl_k3", "k3 estimate of KL(sampler || trainer) per token of the last batch, nats"),
                  ("is_truncated_fraction", "share of the last batch's tokens whose importance ratio exceeded "
                                            "algo.tis_cap"))


# a step's phases on the trainer's main thread, in order, summing to its wall time there: waiting for its plan (made
# there: collecting, batching and packing it; or made ahead by the plan prefetch: waiting for that thread), for the
# previous publication, the update, handing off. The plan's collect/batch/pack seconds are reported too; with
# `prepared_ahead` they ran on the prefetch thread beside the previous update and are no part of the step's time.
MAIN_THREAD_PHASES = ("plan_wait_seconds", "publish_wait_seconds", "compute_seconds", "handoff_seconds")


def main_thread_seconds(phases: dict) -> float:
    """The step's wall time on the trainer's main thread, from its phases."""
    return sum(phases[p] for p in MAIN_THREAD_PHASES)


def component_means(groups, kept: set[str] | None = None,
                    max_series: int = MAX_COMPONENT_SERIES) -> dict[str, float]:
    """`reward/<name>`: the mean of each reward component (task.rewards, weighted 0 or not) over the completions
    that have it, so a run shows each reward it computes (e.g. ifeval_strict beside ifeval_loose).

    `kept`: the names that have a series in this run so far, updated in place (a new name takes a place while fewer
    than `max_series` are kept); values of the other names are folded into `reward/(other)`, their mean. None: every
    name has its own series."""
    values: dict[str, list[float]] = {}
    for c in (c for g in groups for c in g.completions):
        for name, value in c.reward_components.items():
            if kept is not None and name not in kept:
                if len(kept) >= max_series:
                    name = OTHER
                else:
                    kept.add(name)
            values.setdefault(name, []).append(value)
    return {f"reward/{name}": float(np.mean(v)) for name, v in sorted(values.items())}


class StepReporter:
    def __init__(self, cfg: RunConfig, metrics: Tracker, buffer: RolloutBuffer, publisher, held, tokenizer=None):
        """`publisher`: the weight publisher (latest version, samplers' installed versions); `held()`: groups trained
        but not yet acknowledged; `tokenizer`: the trainer's, for the text of sample tables (None: token ids)."""
        self.cfg, self.metrics, self.buffer, self.publisher, self.held = cfg, metrics, buffer, publisher, held
        self.decode = tokenizer.decode if tokenizer is not None else None
        self.prom = ServiceMetrics("trainer")
        self.gauges = {name: self.prom.gauge(name, doc) for name, doc in _GAUGES + _HEALTH_GAUGES}
        # the buffer's run-long counts (kept in Redis, they outlive this process): grpo_stream_groups_total, counters
        self.groups_total = self.prom.counter_values("groups", "rollout groups by outcome since the run began (the "
                                                     "buffer's counters)", "outcome")
        # one series per sampler the publisher still knows, up to a bound; later ones share the `(other)` series
        self.max_lag_series = max(MAX_LAG_SERIES, cfg.sampler.replicas)
        self.lag_gauge = BoundedGauge(self.prom.gauge(
            "sampler_weight_lag", f"latest version minus the sampler's installed version (the first "
            f"{self.max_lag_series} samplers heard from; {OTHER}: the largest lag of the rest)", ("sampler",)),
            self.max_lag_series)
        self.prom.start(cfg.trainer.metrics_host or cfg.trainer.host, cfg.trainer.metrics_port,
                        "trainer.metrics_port")
        self._counters: dict[str, int] = {}
        self._component_names: set[str] = set()  # the reward components with a series of their own (bounded)
        self._folded_warned = False
        self._last_line = 0.0
        self._window: list[tuple[float, int, int]] = []  # (time, tokens, groups) of recent steps, for rates

    def _without_signal(self, groups) -> int:
        """Groups with zero advantages, as algo.dynamic_sampling judges them."""
        return sum(without_signal(g, self.cfg.algo, self.cfg.generation.max_new_tokens) for g in groups)

    def rates(self, tokens: int, groups: int, window_s: float = 30.0) -> tuple[float | None, float | None]:
        """Tokens/s and groups/s trained over the last `window_s` seconds (not a run-long average, which would climb
        all run as start-up time is amortised); (None, None) at the first step of this process, which has no window
        yet: reported as 0, it drew a fall to zero in the throughput at step 1 and at every resume, and its gauge
        read 0 as if the trainer had stalled."""
        now = time.time()
        self._window.append((now, tokens, groups))
        while len(self._window) > 2 and now - self._window[1][0] > window_s:
            self._window.pop(0)
        span = now - self._window[0][0] if len(self._window) > 1 else 0.0
        if span <= 0:
            return None, None
        return (sum(t for _, t, _ in self._window[1:]) / span, sum(g for _, _, g in self._window[1:]) / span)

    def report(self, step, groups, staleness, stats, m, phases, tokens_per_second, groups_per_second) -> None:
        accuracy = float(np.mean([c.reward_components.get("answer_correct", 0.0)
                                  for g in groups for c in g.completions]))
        held = self.held()
        step_seconds = main_thread_seconds(phases)
        try:
            counters = self._counters = self.buffer.counters()
        except BufferUnavailable:  # Redis is away: report the last known counts rather than fail the step
            counters = self._counters or {"depth": 0, "dropped_stale": 0, "dropped_filtered": 0}
        row = {**stats, **m, "accuracy": accuracy, "staleness_mean": float(staleness.mean()),
               "staleness_max": int(staleness.max()),
               # waiting to be trained; those trained but held for a checkpoint are counted apart
               "buffer_depth": max(0, counters["depth"] - held), "buffer_held": held,
               "groups_dropped_stale": counters["dropped_stale"],
               "groups_dropped_filtered": counters["dropped_filtered"], **phases,
               "wait_seconds": phases["plan_wait_seconds"], "step_seconds": step_seconds,
               "compute_share": phases["compute_seconds"] / max(step_seconds, 1e-9),
               "zero_variance_groups": self._without_signal(groups),
               "weight_version": self.publisher.latest_version or 0, **self._component_means(groups)}
        if tokens_per_second is not None:  # None: no window yet (rates), left out rather than logged as 0
            row.update(tokens_per_second=tokens_per_second, groups_per_second=groups_per_second)
        self.metrics.scalars(step, row, prefix="train/")
        self._export(step, row, self._counters)  # the last counts read: never the zeros above, a counter reset
        self.metrics.histogram(step, "train/staleness", staleness)
        lags = bounded_series(self.sampler_lags(), self.max_lag_series)
        if lags:
            self.metrics.samplers(step, {sampler: {"weight_lag": lag} for sampler, lag in lags.items()})
        wanted = self.metrics.samples_wanted(step)  # detokenize only for a tracker that keeps the text
        if wanted:
            self.metrics.samples(step, sample_rows(groups, staleness, wanted, self.decode,
                                                   self.cfg.tracking.wandb.samples_injected))
        if self._show(step):
            lp_diff = f"{m['logprob_diff_max']:.1e}" if "logprob_diff_max" in m else "-"
            log.info("step %d/%d reward %.3f acc %.3f staleness %.1f/%d buffer %d dropped-stale %d version %d "
                     "loss %.4f clip %.3f lp_diff(lag0) %s wait %.2fs %s tok/s", step, self.cfg.trainer.steps,
                     stats["reward_mean"], accuracy, row["staleness_mean"], row["staleness_max"], row["buffer_depth"],
                     row["groups_dropped_stale"], row["weight_version"], m["loss"], m["clip_fraction"], lp_diff,
                     phases["plan_wait_seconds"], "-" if tokens_per_second is None else f"{tokens_per_second:.0f}")
            if "distill_kl" in m:  # distillation: how far the student is from its teacher, per token
                log.info("step %d distill: KL to the teacher %.4f (p50 %.4f, p90 %.4f, p99 %.4f), teacher logprob "
                         "%.4f", step, m["distill_kl"], m["distill_kl_p50"], m["distill_kl_p90"], m["distill_kl_p99"],
                         m["distill_teacher_logprob"])

    def _component_means(self, groups) -> dict[str, float]:
        """component_means with at most MAX_COMPONENT_SERIES series in the run; warns once when names are folded."""
        means = component_means(groups, self._component_names)
        if f"reward/{OTHER}" in means and not self._folded_warned:
            self._folded_warned = True
            folded = sorted({name for g in groups for c in g.completions for name in c.reward_components}
                            - self._component_names)
            log.warning("samplers sent more than %d distinct reward component names; the rest (e.g. %s) are folded "
                        "into train/reward/%s for the rest of the run (a rubric naming its metrics per episode?)",
                        MAX_COMPONENT_SERIES, ", ".join(repr(n) for n in folded[:5]), OTHER)
        return means

    def _show(self, step: int) -> bool:
        """Every step with logging.verbose; else the first, the last, every logging.step_every-th, and one at least
        every logging.summary_every_s seconds."""
        lg, now = self.cfg.logging, time.time()
        show = (lg.verbose or step == 1 or step == self.cfg.trainer.steps or step % lg.step_every == 0
                or now - self._last_line >= lg.summary_every_s)
        if show:
            self._last_line = now
        return show

    def _export(self, step: int, row: dict, counters: dict) -> None:
        """Update the Prometheus series after a step; `counters`: the buffer's counts last read ({} before any)."""
        self.gauges["trainer_step"].set(step)
        for name in ("weight_version", "buffer_depth", "buffer_held", "reward_mean", "accuracy", "staleness_mean",
                     "step_seconds", "wait_seconds", "tokens_per_second", "groups_per_second", "compute_share"):
            if name in row:  # the rates are not there at a process's first step (rates)
                self.gauges[name].set(row[name])
        for name, _ in _HEALTH_GAUGES:
            if row.get(name) is not None:
                self.gauges[name].set(row[name])
        # depth is no count of outcomes (it falls as groups are trained): buffer_depth and buffer_held show it
        self.groups_total.set({outcome: value for outcome, value in counters.items() if outcome != "depth"})
        self.export_sampler_lags()

    def export_sampler_lags(self) -> None:
        """The sampler_weight_lag series: the samplers the publisher knows now (it forgets silent ones), bounded."""
        self.lag_gauge.replace(self.sampler_lags())

    def sampler_lags(self) -> dict[str, int]:
        """Per sampler: newest published version minus the version it reports installed."""
        latest = self.publisher.latest_version or 0
        return {sampler: latest - versions[-1] for sampler, versions in dict(self.publisher.samplers.installed).items()
                if versions}

    def close(self, failed: bool = False) -> None:
        """Close the trackers, then the /metrics server even when closing them failed (a TensorBoard file on a full
        disk): its port and thread would outlive the trainer in the process (tests, benchmarks, colocated runs)."""
        try:
            self.metrics.close(failed)
        finally:
            self.prom.stop()
