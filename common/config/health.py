"""trainer.health: the band that off-policy health diagnostics are judged against
(trainer_service/learning/off_policy_health.py; docs/objective.md, "Off-policy health")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.base import Strict


class HealthSection(Strict):
    """When the trainer warns that training has become too off-policy. Judged on the mean of the last window_steps
    steps, not on one noisy step; a warning is logged at most every warn_every_steps steps and counted
    (health_warnings)."""

    ess_metric: Literal["is_ess_group_mean", "is_ess_token"] = Field(
        "is_ess_group_mean", description="Which effective sample size min_ess bounds. 'is_ess_group_mean': the ESS "
        "(sum w)^2 / (n sum w^2) of the sequence importance weights w = exp(sum_t (o - b)) within each group, "
        "averaged over groups; GRPO compares completions within a group, so it is the share of each group that "
        "effectively counts. A sequence weight multiplies its tokens' ratios, so this ESS falls with completion "
        "length (about exp(-length x var(o - b)) for small independent gaps): with completions of hundreds of "
        "tokens pick 'is_ess_token', the ESS of the per-token ratios the loss actually weights by.")
    min_ess: float = Field(0.5, ge=0, le=1, description="Floor on the mean of ess_metric over the window; 0.5: half "
                           "the samples effectively count. 0 = never warn on ESS.")
    max_mismatch_kl: float | None = Field(0.05, gt=0, le=100, description="Ceiling on mismatch_kl_k3, the per-token "
                                          "k3 estimate of KL(sampler || trainer) in nats. k3 is about E[(o - b)^2]/2 "
                                          "for small gaps, so 0.05 means a typical token's ratio exp(o - b) is "
                                          "about exp(+-0.32) = 0.73..1.37: wider than the clip band 1 +- "
                                          "algo.epsilon, so the truncation (algo.tis_cap) rather than the objective "
                                          "is doing the correcting. Null = never warn on KL.")
    window_steps: int = Field(10, ge=1, le=100_000, description="Steps whose diagnostics are averaged before judging; "
                              "nothing is judged before the first full window (a run shorter than this is never "
                              "judged).")
    warn_every_steps: int = Field(50, ge=1, le=10_000_000, description="At most one warning per this many steps "
                                  "(steps out of the band in between are still counted: health_out_of_band_steps).")

    @model_validator(mode="after")
    def _band(self) -> "HealthSection":
        if self.min_ess >= 1.0:
            raise ValueError(f"trainer.health.min_ess={self.min_ess}: the ESS reaches 1 only when every importance "
                             "weight is equal, so any off-policy step would warn; set it below 1 (default 0.5), or "
                             "0 to turn the ESS check off")
        return self
