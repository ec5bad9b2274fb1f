"""Off-policy health diagnostics (trainer_service/learning/off_policy_health.py) against hand-computed values, the
health monitor's window, wording and rate limit, and the trainer.health config section."""

import math

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.learning.off_policy_health import (IMPORTANCE_KEYS, HealthMonitor, empty_importance,
                                                          group_index_of, importance_diagnostics, log_ess,
                                                          version_diagnostics, version_keys)

LN2 = math.log(2.0)


def one_row(log_ratios, tis_cap=2.0):
    """Diagnostics of one sequence whose tokens all count."""
    x = np.array([log_ratios], np.float64)
    return importance_diagnostics(x, np.ones_like(x), np.zeros(1, np.int64), tis_cap)


# -- effective sample size --------------------------------------------------------------------------------------

def test_equal_weights_have_ess_one():
    # every token ratio e^0.3: (n r)^2 / (n * n r^2) = 1; both sequences weigh e^(3 * 0.3): ESS 1 too
    x = np.full((2, 3), 0.3)
    d = importance_diagnostics(x, np.ones((2, 3)), np.array([0, 0]), 2.0)
    assert d["is_ess_token"] == pytest.approx(1.0, abs=1e-12)
    assert d["is_ess_sequence"] == pytest.approx(1.0, abs=1e-12)
    assert d["is_ess_group_mean"] == d["is_ess_group_min"] == pytest.approx(1.0, abs=1e-12)


def test_one_dominating_weight_gives_one_over_n():
    # r = [e^40, 1, 1, 1]: (e^40 + 3)^2 / (4 (e^80 + 3)) = 1/4 up to ~e^-40
    assert one_row([40.0, 0.0, 0.0, 0.0])["is_ess_token"] == pytest.approx(0.25, abs=1e-12)
    assert log_ess(np.array([40.0] + [0.0] * 9)) == pytest.approx(0.1, abs=1e-12)


def test_two_and_three_weight_cases_by_hand():
    # r = [1, 2]: (1 + 2)^2 / (2 * (1 + 4)) = 9 / 10
    assert one_row([0.0, LN2])["is_ess_token"] == pytest.approx(0.9, abs=1e-12)
    # r = [1, 1, 4]: (1 + 1 + 4)^2 / (3 * (1 + 1 + 16)) = 36 / 54 = 2/3
    assert log_ess(np.log([1.0, 1.0, 4.0])) == pytest.approx(2.0 / 3.0, abs=1e-12)
    assert log_ess(np.array([])) == 1.0 and log_ess(np.array([-3.0])) == 1.0


def test_group_ess_mean_and_min_with_non_adjacent_labels():
    # rows (label, token log-ratios, mask) -> sequence log-weight (sum over masked tokens):
    #   7: [0, 0]          -> W = 1
    #   3: [ln2, ln2]      -> W = 4
    #   7: [ln2, 0]        -> W = 2
    #   3: [0, 0]          -> W = 1
    #   3: [0, 9 masked]   -> W = 1 (the masked 9 is not read)
    #   5: [0, 0]          -> W = 1, and 5's other row is fully masked: group 5 has one non-empty sequence, skipped
    #   5: [9, 9 masked]   -> empty
    # group 7: W = [1, 2] -> 9/10; group 3: W = [4, 1, 1] -> 36/54 = 2/3
    # mean (0.9 + 2/3) / 2 = 47/60, min 2/3
    # is_ess_sequence over the 6 non-empty sequences W = [1, 4, 2, 1, 1, 1]: sum 10, sum of squares 24,
    #   100 / (6 * 24) = 25/36
    x = np.array([[0, 0], [LN2, LN2], [LN2, 0], [0, 0], [0, 9], [0, 0], [9, 9]], np.float64)
    mask = np.array([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [0, 0]], np.float32)
    d = importance_diagnostics(x, mask, np.array([7, 3, 7, 3, 3, 5, 5]), None)
    assert d["is_ess_group_mean"] == pytest.approx(47.0 / 60.0, abs=1e-12)
    assert d["is_ess_group_min"] == pytest.approx(2.0 / 3.0, abs=1e-12)
    assert d["is_ess_sequence"] == pytest.approx(25.0 / 36.0, abs=1e-12)


def test_no_group_with_two_sequences_gives_group_ess_one():
    x = np.array([[0.0, 5.0], [1.0, 0.0]])
    d = importance_diagnostics(x, np.ones((2, 2)), np.array([0, 1]), 2.0)
    assert d["is_ess_group_mean"] == d["is_ess_group_min"] == 1.0


def test_long_sequences_do_not_overflow():
    # 10,000 tokens of log-ratio 0.5: the sequence weight is e^5000 (inf in a direct exp). Two such sequences,
    # the second with one more token of ln 2: weights e^5000 * [1, 2] -> ESS 9/10 (scale-free), as in the
    # two-weight case
    n = 10_000
    x = np.zeros((2, n + 1))
    x[:, :n] = 0.5
    x[1, n] = LN2
    mask = np.ones_like(x)
    mask[0, n] = 0.0
    d = importance_diagnostics(x, mask, np.array([0, 0]), 2.0)
    assert all(math.isfinite(v) for v in d.values()), d
    assert d["is_ess_sequence"] == pytest.approx(0.9, abs=1e-9)
    assert d["is_ess_group_mean"] == pytest.approx(0.9, abs=1e-9)
    # one sequence at e^5000, the other at e^0: the first carries everything, ESS 1/2
    x[1] = 0.0
    d = importance_diagnostics(x, mask, np.array([0, 0]), 2.0)
    assert d["is_ess_sequence"] == pytest.approx(0.5, abs=1e-12)


# -- mismatch KL, quantiles, truncation -------------------------------------------------------------------------

def test_k1_and_k3_by_hand():
    # x = o - b = [ln2, -ln2]: r = [2, 1/2]
    # k1 = mean(b - o) = mean(-x) = 0
    # k3 = mean(r - 1 - x) = ((2 - 1 - ln2) + (1/2 - 1 + ln2)) / 2 = (1 - 1/2) / 2 = 0.25
    d = one_row([LN2, -LN2])
    assert d["mismatch_kl_k1"] == pytest.approx(0.0, abs=1e-15)
    assert d["mismatch_kl_k3"] == pytest.approx(0.25, abs=1e-15)
    # x = [0.5, 0, 0, 0]: k1 = -0.5 / 4 = -0.125; k3 = (e^0.5 - 1 - 0.5) / 4 = (1.6487212707 - 1.5) / 4
    d = one_row([0.5, 0.0, 0.0, 0.0])
    assert d["mismatch_kl_k1"] == pytest.approx(-0.125, abs=1e-15)
    assert d["mismatch_kl_k3"] == pytest.approx(0.0371803177, abs=1e-10)


def test_k3_is_never_negative_for_tiny_gaps():
    d = one_row([1e-12, -1e-12, 3e-9, -7e-10])
    assert d["mismatch_kl_k3"] >= 0.0


def test_ratio_quantiles_by_linear_interpolation():
    # r = [0.5, 1, 2, 4, 8] (given shuffled); numpy's linear method: position q * (n - 1) = 4q between order stats
    # p01: 0.04 -> 0.5 + 0.04 * (1 - 0.5) = 0.52      p10: 0.4 -> 0.5 + 0.4 * 0.5 = 0.7
    # p50: 2    -> 2                                  p90: 3.6 -> 4 + 0.6 * (8 - 4) = 6.4
    # p99: 3.96 -> 4 + 0.96 * 4 = 7.84
    d = one_row(np.log([4.0, 0.5, 8.0, 1.0, 2.0]).tolist())
    got = [d[f"is_ratio_{p}"] for p in ("p01", "p10", "p50", "p90", "p99")]
    assert got == pytest.approx([0.52, 0.7, 2.0, 6.4, 7.84], abs=1e-12)


def test_truncated_fraction():
    # r = [0.5, 1, 2, 4, 8] with cap 2: 4 and 8 exceed it (2 itself does not): 2/5
    x = np.log([0.5, 1.0, 2.0, 4.0, 8.0]).tolist()
    assert one_row(x, tis_cap=2.0)["is_truncated_fraction"] == pytest.approx(0.4)
    assert one_row(x, tis_cap=None)["is_truncated_fraction"] == 0.0
    assert one_row(x, tis_cap=100.0)["is_truncated_fraction"] == 0.0


def test_padding_is_never_read():
    # NaN and huge values where the mask is 0 change nothing: same as the two-token row [0, ln2]
    x = np.array([[0.0, LN2, np.nan, 1e9]])
    d = importance_diagnostics(x, np.array([[1, 1, 0, 0]]), np.array([0]), 2.0)
    assert d == one_row([0.0, LN2])


def test_no_masked_token_is_well_defined():
    d = importance_diagnostics(np.full((2, 3), np.nan), np.zeros((2, 3)), np.array([0, 0]), 2.0)
    assert d == empty_importance()
    assert tuple(d) == IMPORTANCE_KEYS
    assert d["is_ess_token"] == d["is_ess_sequence"] == d["is_ess_group_mean"] == d["is_ess_group_min"] == 1.0
    assert d["mismatch_kl_k1"] == d["mismatch_kl_k3"] == d["is_truncated_fraction"] == 0.0
    assert d["is_ratio_p01"] == d["is_ratio_p50"] == d["is_ratio_p99"] == 1.0


def test_every_result_has_the_same_keys_and_shapes_are_checked():
    assert tuple(one_row([0.1, -0.2])) == IMPORTANCE_KEYS
    with pytest.raises(ValueError, match="expected"):
        importance_diagnostics(np.zeros((2, 3)), np.ones((2, 4)), np.zeros(2), 2.0)
    with pytest.raises(ValueError, match="expected"):
        importance_diagnostics(np.zeros((2, 3)), np.ones((2, 3)), np.zeros(3), 2.0)


# -- version histogram ------------------------------------------------------------------------------------------

def completion(n, versions=None):
    return CompletionData(token_ids=np.zeros(n, np.int32), logprobs=np.zeros(n, np.float32), reward=0.0,
                          truncated=False, versions=None if versions is None else np.array(versions, np.int64))


def group(policy_version, *completions):
    return GroupData(group_id="g", prompt_id="p", prompt_token_ids=np.ones(2, np.int32),
                     completions=list(completions), policy_version=policy_version, sampler_id="s")


def test_version_histogram_with_mixed_versions():
    # trainer holds version 10 (step 11), max_staleness 3; lag = 10 - version
    # A, policy 8: 4 + 2 tokens, no per-token versions -> 6 tokens at lag 2            (not mixed)
    # B, policy 9: [9, 9, 10] -> lag 1, 1, 0; 3 tokens None (= 9) -> lag 1 x 3          (mixed)
    # C, policy 7: [7, 8, 8, 10] -> lag 3, 2, 2, 0; 2 tokens None (= 7) -> lag 3 x 2    (mixed)
    # all 18 tokens: lag0 2, lag1 5, lag2 6 + 2 = 8, lag3 3
    # mixed B + C, 12 tokens: lag0 2, lag1 5, lag2 2, lag3 3
    groups = [group(8, completion(4), completion(2)),
              group(9, completion(3, [9, 9, 10]), completion(3)),
              group(7, completion(4, [7, 8, 8, 10]), completion(2))]
    d = version_diagnostics(groups, held_version=10, max_staleness=3)
    assert tuple(d) == version_keys(3)
    assert [d[f"staleness_tokens_lag{s}"] for s in range(4)] == pytest.approx([2 / 18, 5 / 18, 8 / 18, 3 / 18])
    assert d["mixed_version_groups"] == 2.0
    assert [d[f"mixed_version_tokens_lag{s}"] for s in range(4)] == pytest.approx([2 / 12, 5 / 12, 2 / 12, 3 / 12])


def test_version_keys_are_bounded_and_zero_filled():
    # one group at policy 5, trainer holding 5: every token at lag 0; lags 1..4 present as 0; nothing mixed
    d = version_diagnostics([group(5, completion(3), completion(1))], held_version=5, max_staleness=4)
    assert set(d) == set(version_keys(4)) and len(d) == 11
    assert d["staleness_tokens_lag0"] == 1.0
    assert all(d[f"staleness_tokens_lag{s}"] == 0.0 for s in range(1, 5))
    assert d["mixed_version_groups"] == 0.0
    assert all(d[f"mixed_version_tokens_lag{s}"] == 0.0 for s in range(5))
    assert all(v == 0.0 for v in version_diagnostics([], 5, 4).values())


def test_token_lag_matches_the_trainers_group_staleness():
    # without per-token versions a token's lag is the group staleness loop.py logs: (step - 1) - policy_version
    step, groups = 7, [group(6, completion(2)), group(4, completion(2)), group(4, completion(4))]
    d = version_diagnostics(groups, held_version=step - 1, max_staleness=4)
    staleness = [step - 1 - g.policy_version for g in groups]  # [0, 2, 2]: 2 tokens at 0, 6 at 2
    assert staleness == [0, 2, 2]
    assert d["staleness_tokens_lag0"] == pytest.approx(2 / 8) and d["staleness_tokens_lag2"] == pytest.approx(6 / 8)


def test_a_group_whose_completions_differ_in_version_is_mixed():
    # policy 3: one completion all at 3 (None), one all at 4 -> the group's tokens span two versions
    d = version_diagnostics([group(3, completion(2), completion(2, [4, 4]))], held_version=4, max_staleness=2)
    assert d["mixed_version_groups"] == 1.0
    assert d["mixed_version_tokens_lag0"] == d["mixed_version_tokens_lag1"] == 0.5


def test_observation_tokens_are_not_in_the_version_histogram():
    # multi-turn, policy 3, trainer holding 4: model turn [3, 3], observation [3, 3, 3] (the turn before's version),
    # model turn [4]; no version drew the observation tokens, so only the 3 model tokens count: 2 at lag 1, 1 at 0
    multi = completion(6, [3, 3, 3, 3, 3, 4])
    multi.model_mask = np.array([1, 1, 0, 0, 0, 1], np.bool_)
    d = version_diagnostics([group(3, multi)], held_version=4, max_staleness=2)
    assert [d[f"staleness_tokens_lag{s}"] for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 0.0])
    assert [d[f"mixed_version_tokens_lag{s}"] for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 0.0])


def test_group_index_follows_the_batch_rows():
    groups = [group(0, completion(1), completion(1)), group(0, completion(1), completion(1), completion(1))]
    assert group_index_of(groups).tolist() == [0, 0, 1, 1, 1]


# -- health monitor ---------------------------------------------------------------------------------------------

def config(*overrides):
    return load_config(None, ["trainer.health.window_steps=3", "trainer.health.warn_every_steps=5",
                              "sampler.weight_updates=drain", *overrides])


def healthy(**changes):
    return {**empty_importance(), "staleness_tokens_lag0": 0.5, "staleness_tokens_lag1": 0.5, **changes}


def test_monitor_warns_only_when_the_window_mean_leaves_the_band():
    cfg, monitor = config(), HealthMonitor()
    assert monitor.observe(1, healthy(is_ess_group_mean=0.1), cfg) is None  # window not full yet
    assert monitor.observe(2, healthy(is_ess_group_mean=0.1), cfg) is None
    message = monitor.observe(3, healthy(is_ess_group_mean=0.1), cfg)  # mean 0.1 < 0.5
    assert message.startswith("step 3: training is too off-policy: per-group ESS 0.10 (mean of the last 3 steps) "
                              "< trainer.health.min_ess 0.5"), message
    assert message.endswith("Tokens are 0.5 versions behind on average. Lower trainer.max_staleness (now 4), let "
                            "samplers switch weights mid-group (sampler.weight_updates=in_flight, now "
                            "drain), or take smaller steps (trainer.learning_rate=0.001); algo.tis_cap=2.0 "
                            "bounds each token's weight meanwhile."), message
    assert monitor.metrics() == {"health_warnings": 1.0, "health_out_of_band_steps": 1.0}


def test_one_noisy_step_does_not_warn():
    cfg, monitor = config(), HealthMonitor()
    # window [0.9, 0.9, 0.2]: mean 2.0 / 3 = 0.667 >= 0.5
    for step, ess in enumerate([0.9, 0.9, 0.2], start=1):
        assert monitor.observe(step, healthy(is_ess_group_mean=ess), cfg) is None
    # then [0.9, 0.2, 0.3]: mean 1.4 / 3 = 0.467 < 0.5
    assert monitor.observe(4, healthy(is_ess_group_mean=0.3), cfg).startswith("step 4: ")


def test_monitor_respects_the_rate_limit_and_counts_every_step_out_of_band():
    cfg, monitor = config(), HealthMonitor()
    said = {step: monitor.observe(step, healthy(is_ess_group_mean=0.2), cfg) for step in range(1, 14)}
    # out of band from step 3 (first full window); warned at 3, then 5 steps later at 8 and 13
    assert [step for step, m in said.items() if m] == [3, 8, 13]
    assert monitor.metrics() == {"health_warnings": 3.0, "health_out_of_band_steps": 11.0}


def test_token_ess_can_be_the_judged_one():
    cfg, monitor = config("trainer.health.ess_metric=is_ess_token"), HealthMonitor()
    # per-group ESS far below the floor, token ESS above it: no warning, then token ESS below: warns
    said = [monitor.observe(s, healthy(is_ess_group_mean=0.05, is_ess_token=0.9), cfg) for s in (1, 2, 3)]
    assert said == [None, None, None]
    # token-ESS windows [0.9, 0.9, 0.1] at step 4 (mean 0.63) and [0.9, 0.1, 0.1] at step 5 (mean 0.37): warns at 5
    said = [monitor.observe(s, healthy(is_ess_group_mean=0.9, is_ess_token=0.1), cfg) for s in (4, 5)]
    assert said[0] is None
    assert said[1].startswith("step 5: training is too off-policy: token ESS 0.37 (mean of the last 3 steps) < "
                              "trainer.health.min_ess 0.5."), said[1]


def test_mismatch_kl_ceiling_and_lag_zero_advice():
    cfg, monitor = config(), HealthMonitor()
    step_diag = healthy(mismatch_kl_k3=0.1, staleness_tokens_lag0=1.0, staleness_tokens_lag1=0.0)
    messages = [monitor.observe(step, step_diag, cfg) for step in (1, 2, 3)]
    assert messages[:2] == [None, None]
    assert "mismatch KL (k3) 0.1 (mean of the last 3 steps) > trainer.health.max_mismatch_kl 0.05" in messages[2]
    # every token came from the trainer's own weights: the gap is numerical, not staleness
    assert "sampler.dtype=float32, the trainer in model.dtype=float32" in messages[2]
    assert "max_staleness" not in messages[2]


def test_nan_is_out_of_the_band_and_checks_can_be_turned_off():
    monitor = HealthMonitor()
    said = [monitor.observe(s, healthy(is_ess_group_mean=float("nan")), config()) for s in (1, 2, 3)]
    assert said[2] is not None and "per-group ESS nan" in said[2]
    off, monitor = config("trainer.health.min_ess=0", "trainer.health.max_mismatch_kl=null"), HealthMonitor()
    bad = healthy(is_ess_group_mean=0.01, mismatch_kl_k3=5.0)
    assert all(monitor.observe(s, bad, off) is None for s in range(1, 10))
    assert monitor.metrics()["health_warnings"] == 0.0


def test_advice_names_only_remedies_not_taken_and_steps_without_keys_are_skipped():
    def warning(*overrides):
        cfg, monitor = config(*overrides), HealthMonitor()
        assert monitor.observe(1, {}, cfg) is None  # no diagnostics: nothing to judge or count
        said = [monitor.observe(s, healthy(is_ess_group_mean=0.1), cfg) for s in (2, 3, 4)]
        assert said[:2] == [None, None] and said[2] is not None
        return said[2]

    # nothing to lower, versions already switch mid-group
    assert warning("sampler.weight_updates=in_flight", "trainer.max_staleness=0").endswith(
        "Take smaller steps (trainer.learning_rate=0.001); algo.tis_cap=2.0 bounds each token's weight meanwhile.")
    assert "Lower trainer.max_staleness (now 4), publish weights more often (trainer.publish_every=2), let samplers" \
        in warning("trainer.publish_every=2")


def test_without_tis_the_advice_says_nothing_corrects_the_stale_tokens():
    """algo.tis_cap=null: no importance weight at all (w = 1), so the warning must not claim a cap bounds anything;
    it names the setting that turns the correction on. GSPO's clip is named for gspo-token."""
    def advice(*overrides):
        cfg, monitor = config(*overrides), HealthMonitor()
        return [monitor.observe(s, healthy(is_ess_group_mean=0.1), cfg) for s in (1, 2, 3)][2]

    said = advice("algo.tis_cap=null")
    assert "bounds each token's weight" not in said and "tis_cap=None" not in said, said
    assert said.endswith("nothing corrects for the stale tokens meanwhile (algo.tis_cap is null): set algo.tis_cap "
                         "(default 2.0) to weight each token by its truncated importance ratio."), said
    assert advice("algo.loss_algo=gspo-token").endswith("GSPO's clip (0.0003 / 0.0004) bounds each sequence's ratio "
                                                        "meanwhile.")


# -- trainer.health config --------------------------------------------------------------------------------------

def test_health_defaults():
    health = load_config(None).trainer.health
    assert (health.ess_metric, health.min_ess, health.max_mismatch_kl, health.window_steps,
            health.warn_every_steps) == ("is_ess_group_mean", 0.5, 0.05, 10, 50)


@pytest.mark.parametrize("override, message", [
    ("trainer.health.min_ess=1", r"trainer\.health\.min_ess=1\.0: the ESS reaches 1 only when every importance "
                                 r"weight is equal.*set it below 1"),
    ("trainer.health.min_ess=1.5", r"trainer\.health\.min_ess: Input should be less than or equal to 1"),
    ("trainer.health.window_steps=0", r"trainer\.health\.window_steps: Input should be greater than or equal to 1"),
    ("trainer.health.max_mismatch_kl=0", r"trainer\.health\.max_mismatch_kl: Input should be greater than 0"),
    ("trainer.health.min_es=0.3", r"trainer\.health\.min_es: unknown key"),
])
def test_health_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
