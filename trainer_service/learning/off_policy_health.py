"""Off-policy health of a trainer step: how far the tokens it trains on are from the trainer's own policy.

The trainer trains on tokens that samplers drew with weight versions up to `trainer.max_staleness` steps old and
corrects for that with truncated importance sampling, w = min(exp(o - b), algo.tis_cap) per token (loss.py), where
o is the trainer's (proximal) log-prob of the token at the start of the step and b the sampler's behaviour log-prob.
That correction works while the two policies are close; these diagnostics say how close they are
(docs/objective.md, "Off-policy health"). Pure numpy on the host, float64 inside:

  importance_diagnostics   from per-token log-ratios o - b: effective sample sizes (tokens, sequences, within
                           groups), KL(behaviour || trainer) estimates, ratio quantiles, the truncated share
  version_diagnostics      from the groups' per-token weight versions: the staleness histogram by tokens, and
                           how many groups mix versions (sampler.weight_updates=in_flight)
  HealthMonitor            judges a window of steps against trainer.health and words the warning

Every function returns a dict of floats with a fixed key set (keys become train/<key> metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: the module needs numpy alone at run time
    from grpo_stream.common.config.schema import RunConfig
    from grpo_stream.common.rollouts.wire import CompletionData, GroupData

# Log-ratios are clipped to +-LOG_RATIO_CLIP before anything is computed: a token ratio beyond e^50 is hopeless
# either way, and the clip keeps every figure finite (exp(50) ~ 5e21, and sums of them, fit float64). It never
# changes the truncated share: algo.tis_cap <= 1e6 < e^50.
LOG_RATIO_CLIP = 50.0
QUANTILES = (("p01", 0.01), ("p10", 0.10), ("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
IMPORTANCE_KEYS = ("is_ess_token", "is_ess_sequence", "is_ess_group_mean", "is_ess_group_min", "mismatch_kl_k1",
                   "mismatch_kl_k3", *(f"is_ratio_{name}" for name, _ in QUANTILES), "is_truncated_fraction")


def log_ess(log_weights: np.ndarray) -> float:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) of weights given by their logs, in (0, 1].

    Computed as exp(2 lse(x) - lse(2x) - log n) with lse = log-sum-exp, so weights of any size (a long sequence's
    product of token ratios) neither overflow nor underflow. 1 when all weights are equal (or n = 1); about 1/n when
    one weight dominates. n = 0 gives 1.0 (nothing is unevenly weighted)."""
    x = np.asarray(log_weights, np.float64)
    if x.size == 0:
        return 1.0
    value = np.exp(2.0 * _log_sum_exp(x) - _log_sum_exp(2.0 * x) - np.log(x.size))
    return float(min(value, 1.0))  # Cauchy-Schwarz bounds it by 1; rounding may land a hair above


def _log_sum_exp(x: np.ndarray) -> float:
    top = np.max(x)
    return float(top + np.log(np.sum(np.exp(x - top))))


def empty_importance() -> dict[str, float]:
    """What importance_diagnostics returns when no token is in the loss: the values of a batch sampled exactly on
    policy (every ratio 1): ESS 1.0, KL 0.0, every quantile 1.0, nothing truncated. Well defined, never NaN."""
    out = {key: 1.0 for key in IMPORTANCE_KEYS}
    out.update(mismatch_kl_k1=0.0, mismatch_kl_k3=0.0, is_truncated_fraction=0.0)
    return out


def importance_diagnostics(log_ratio: np.ndarray, mask: np.ndarray, group_index: np.ndarray,
                           tis_cap: float | None) -> dict[str, float]:
    """Importance-weight diagnostics of one step's batch (keys: IMPORTANCE_KEYS).

    Args:
      log_ratio: [N, W] o - b per token: the trainer's proximal log-prob minus the sampler's behaviour log-prob.
        Only read where mask > 0 (padding may hold anything).
      mask: [N, W] tokens in the loss (> 0: in; the values are not used as weights).
      group_index: [N] int, the group each row belongs to (any labels; rows of a group need not be adjacent).
      tis_cap: algo.tis_cap, or None when truncation is off.

    Returns, with r = exp(o - b) per masked token and W_i = exp(sum_t (o - b)) per sequence with >= 1 masked token
    (the sequence's importance weight, the product of its token ratios):
      is_ess_token          (sum r)^2 / (n sum r^2) over the masked tokens: 1 = all ratios equal, ~1/n = one
                            token carries the batch. Of the untruncated ratios.
      is_ess_sequence       the same over the sequence weights W_i (log space, so long sequences do not overflow).
      is_ess_group_mean/min the sequence-weight ESS within each group with >= 2 non-empty sequences, mean and min
                            over those groups (1.0 when there is none). GRPO's advantages are within groups, so this
                            is the share of each group that effectively counts.
      mismatch_kl_k1        mean over tokens of b - o, and
      mismatch_kl_k3        mean of r - 1 - log r (>= 0): Schulman's k1 and k3 estimates of KL(behaviour || trainer)
                            per token, in nats, from the tokens the sampler drew (k1 is unbiased but can be
                            negative; k3 is unbiased and never negative).
      is_ratio_p01..p99     the 1/10/50/90/99% quantiles of r over the masked tokens (numpy's default "linear"
                            interpolation between the two nearest order statistics).
      is_truncated_fraction share of masked tokens with r > tis_cap (0.0 when tis_cap is None).
    Log-ratios are clipped to +-LOG_RATIO_CLIP first. No masked token: empty_importance(). Non-finite log-ratios on
    masked tokens propagate as NaN (a NaN log-prob is a bug to see, not to hide).
    """
    log_ratio = np.asarray(log_ratio, np.float64)
    mask = np.asarray(mask) > 0
    group_index = np.asarray(group_index)
    if log_ratio.ndim != 2 or mask.shape != log_ratio.shape or group_index.shape != log_ratio.shape[:1]:
        raise ValueError(f"log_ratio {log_ratio.shape}, mask {mask.shape} and group_index {group_index.shape}: "
                         "expected [N, W], [N, W] and [N]")
    x = np.clip(log_ratio, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    tokens = x[mask]
    if tokens.size == 0:
        return empty_importance()
    ratio = np.exp(tokens)
    nonempty = mask.any(axis=1)
    seq_log_w = np.where(mask, x, 0.0).sum(axis=1)[nonempty]
    group_mean, group_min = _group_ess(seq_log_w, group_index[nonempty])
    out = {"is_ess_token": log_ess(tokens), "is_ess_sequence": log_ess(seq_log_w),
           "is_ess_group_mean": group_mean, "is_ess_group_min": group_min,
           "mismatch_kl_k1": float(np.mean(-tokens)),
           # r - 1 - log r as expm1(x) - x: exact to rounding for small x, where r - 1 - x would cancel
           "mismatch_kl_k3": float(np.mean(np.maximum(np.expm1(tokens) - tokens, 0.0)))}
    values = np.quantile(ratio, [q for _, q in QUANTILES])  # method="linear", numpy's default
    out.update({f"is_ratio_{name}": float(v) for (name, _), v in zip(QUANTILES, values)})
    out["is_truncated_fraction"] = 0.0 if tis_cap is None else float(np.mean(ratio > tis_cap))
    return out


def _group_ess(seq_log_w: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """(mean, min) over groups with >= 2 sequences of the ESS of their sequence weights; (1.0, 1.0) when none."""
    order = np.argsort(groups, kind="stable")
    starts = np.flatnonzero(np.r_[True, groups[order][1:] != groups[order][:-1]]) if groups.size else []
    values = [log_ess(part) for part in np.split(seq_log_w[order], starts[1:]) if part.size >= 2]
    if not values:
        return 1.0, 1.0
    return float(np.mean(values)), float(np.min(values))


def group_index_of(groups: list[GroupData]) -> np.ndarray:
    """[N] group of each row of the batch that batching.build_batch makes from `groups` (completions in order)."""
    return np.repeat(np.arange(len(groups)), [len(g.completions) for g in groups])


def token_versions(group: GroupData, completion: CompletionData) -> np.ndarray:
    """[n] int64 weight version that drew each of the completion's tokens (None on the wire: the group's)."""
    if completion.versions is None:
        return np.full(len(completion.token_ids), group.policy_version, np.int64)
    return np.asarray(completion.versions, np.int64)


def version_keys(max_staleness: int) -> tuple[str, ...]:
    """The keys version_diagnostics returns for `max_staleness` (always all of them)."""
    lags = range(max_staleness + 1)
    return (*(f"staleness_tokens_lag{s}" for s in lags), "mixed_version_groups",
            *(f"mixed_version_tokens_lag{s}" for s in lags))


def version_diagnostics(groups: list[GroupData], held_version: int, max_staleness: int) -> dict[str, float]:
    """The staleness of a step's tokens by the version that drew each one (keys: version_keys(max_staleness)).

    A token drawn with version v, trained while the trainer holds `held_version` (step s holds s - 1; loop.py), has
    lag held_version - v: the group staleness of loop.py, per token. A group's policy_version is its oldest token's
    (wire.py), so a token's lag is at most its group's, and a batch the collector selected has lags in
    0..max_staleness. A lag outside that range is counted at the nearest end (below 0 only for versions made by an
    earlier trainer process that got further before a restart).

      staleness_tokens_lag{s}   share of all sampled completion tokens (those masked out of the loss too, but not
                                a multi-turn completion's observation tokens, which no version drew) drawn at lag s,
                                s = 0..max_staleness, zeros included, so the series are continuous; all zero when
                                there are no tokens.
      mixed_version_groups      groups whose tokens span more than one version (only with
                                sampler.weight_updates=in_flight; across all the group's completions, so also a
                                group whose completions each have one version, but different ones).
      mixed_version_tokens_lag{s} the same shares among the tokens of those groups only (all zero when none).
    """
    size = max_staleness + 1
    counts, mixed_counts, mixed_groups = np.zeros(size), np.zeros(size), 0
    for group in groups:
        if not group.completions:
            continue
        versions = np.concatenate([token_versions(group, c)[c.model_tokens()] for c in group.completions])
        if versions.size == 0:
            continue
        lags = np.clip(held_version - versions, 0, max_staleness)
        hist = np.bincount(lags, minlength=size)
        counts += hist
        if versions.min() != versions.max():
            mixed_groups += 1
            mixed_counts += hist
    out = {f"staleness_tokens_lag{s}": float(v) for s, v in enumerate(counts / max(counts.sum(), 1.0))}
    out["mixed_version_groups"] = float(mixed_groups)
    out.update({f"mixed_version_tokens_lag{s}": float(v)
                for s, v in enumerate(mixed_counts / max(mixed_counts.sum(), 1.0))})
    return out


def mean_token_lag(diagnostics: dict[str, float]) -> float | None:
    """Mean lag of the step's tokens from version_diagnostics' histogram (None without one)."""
    shares = {int(key.removeprefix("staleness_tokens_lag")): v for key, v in diagnostics.items()
              if key.startswith("staleness_tokens_lag")}
    if not shares or sum(shares.values()) == 0:
        return None
    return sum(s * v for s, v in shares.items()) / sum(shares.values())


class HealthMonitor:
    """Judges the mean of the last trainer.health.window_steps steps' diagnostics against trainer.health and words
    a warning (at most one every warn_every_steps steps) naming the settings that would help, with their values.

    Judged: trainer.health.ess_metric (is_ess_group_mean by default: GRPO's advantages are within groups, so the
    per-group sequence ESS is what an off-policy batch loses; is_ess_token for long completions) against min_ess,
    and mismatch_kl_k3 against max_mismatch_kl. A step without a key is not counted in that key's window. NaN counts
    as out of the band.
    """

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {"is_ess_group_mean": [], "is_ess_token": [], "mismatch_kl_k3": [],
                                                "lag": []}
        self._last_warning: int | None = None
        self.warnings = 0           # warnings returned (rate limited)
        self.out_of_band_steps = 0  # steps whose window mean was out of the band, warned or not

    def metrics(self) -> dict[str, float]:
        """health_warnings and health_out_of_band_steps so far (run-long counts; report them every step)."""
        return {"health_warnings": float(self.warnings), "health_out_of_band_steps": float(self.out_of_band_steps)}

    def observe(self, step: int, diagnostics: dict[str, float], cfg: RunConfig) -> str | None:
        """Record a step's diagnostics (importance_diagnostics' and version_diagnostics' keys) and return the
        warning to log (at WARNING) when the window mean is out of the band and the rate limit allows; else None."""
        health = cfg.trainer.health
        values = {key: diagnostics.get(key) for key in self._values}
        values["lag"] = mean_token_lag(diagnostics)
        for key, value in values.items():
            if value is not None:
                window = self._values[key]
                window.append(float(value))
                del window[:-health.window_steps]
        problems = self._problems(cfg)
        if not problems:
            return None
        self.out_of_band_steps += 1
        if self._last_warning is not None and step - self._last_warning < health.warn_every_steps:
            return None
        self._last_warning = step
        self.warnings += 1
        return f"step {step}: training is too off-policy: {'; '.join(problems)}. {self._advice(cfg)}"

    def _full_mean(self, key: str, window_steps: int) -> float | None:
        values = self._values[key]
        return float(np.mean(values)) if len(values) >= window_steps else None

    def _problems(self, cfg: RunConfig) -> list[str]:
        health = cfg.trainer.health
        n = health.window_steps
        ess, kl = self._full_mean(health.ess_metric, n), self._full_mean("mismatch_kl_k3", n)
        problems = []
        if ess is not None and health.min_ess > 0 and not ess >= health.min_ess:
            what = "per-group ESS" if health.ess_metric == "is_ess_group_mean" else "token ESS"
            problems.append(f"{what} {ess:.2f} (mean of the last {n} steps) < trainer.health.min_ess "
                            f"{health.min_ess}")
        if kl is not None and health.max_mismatch_kl is not None and not kl <= health.max_mismatch_kl:
            problems.append(f"mismatch KL (k3) {kl:.3g} (mean of the last {n} steps) > "
                            f"trainer.health.max_mismatch_kl {health.max_mismatch_kl}")
        return problems

    def _advice(self, cfg: RunConfig) -> str:
        """What to change, with the values now (a remedy already taken is left out). Tokens trained at lag 0 (made
        with the trainer's own weights) point at a numerical gap between sampler and trainer, not staleness."""
        trainer, lags = cfg.trainer, self._values["lag"]
        mean_lag = float(np.mean(lags)) if lags else None
        if mean_lag is not None and mean_lag < 0.05:
            dtypes = (f"samplers compute in sampler.dtype={cfg.sampler_dtype()}, the trainer in "
                      f"model.dtype={cfg.model.dtype}")
            return (f"Tokens were drawn with the trainer's own weights (mean lag {mean_lag:.2f}), so sampler and "
                    f"trainer compute different log-probs for the same weights ({dtypes}): run both in one dtype, "
                    f"or check the sampler engine (sampler.engine={cfg.sampler.engine}).")
        remedies = [f"lower trainer.max_staleness (now {trainer.max_staleness})"] if trainer.max_staleness else []
        if trainer.publish_every > 1:
            remedies.append(f"publish weights more often (trainer.publish_every={trainer.publish_every})")
        if cfg.sampler.weight_updates != "in_flight":
            remedies.append(f"let samplers switch weights mid-group (sampler.weight_updates=in_flight, now "
                            f"{cfg.sampler.weight_updates})")
        remedies.append(f"take smaller steps (trainer.learning_rate={trainer.learning_rate:g})")
        behind = "" if mean_lag is None else f"Tokens are {mean_lag:.1f} versions behind on average. "
        options = remedies[0] if len(remedies) == 1 else ", ".join(remedies[:-1]) + ", or " + remedies[-1]
        algo = cfg.algo
        if algo.loss_algo != "grpo":
            bound = f"GSPO's clip ({algo.eps_low:g} / {algo.eps_high:g}) bounds each sequence's ratio meanwhile"
        elif algo.tis_cap is None:  # no importance weight at all: stale tokens train as if drawn by the trainer
            bound = ("nothing corrects for the stale tokens meanwhile (algo.tis_cap is null): set algo.tis_cap "
                     "(default 2.0) to weight each token by its truncated importance ratio")
        else:
            bound = f"algo.tis_cap={algo.tis_cap} bounds each token's weight meanwhile"
        return f"{behind}{options[0].upper()}{options[1:]}; {bound}."
