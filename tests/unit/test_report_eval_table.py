"""report.md's held-out figures: pass@k / maj@k columns by k as a number, and the summary's sampled pass@1 shown for
a run without eval_before (trainer.eval_before=false) too."""

from grpo_stream.reports.run_report import eval_table, summary_table


def test_sampled_columns_are_in_numeric_order_of_k():
    row = {"step": 4, "eval/accuracy": 0.5, "eval/reward": 0.5,
           **{f"eval/pass_at_{k}": k / 20 for k in (1, 2, 4, 8, 16)},
           **{f"eval/maj_at_{k}": k / 40 for k in (1, 2, 4, 8, 16)}}
    header = eval_table([row])[0]
    assert header == ("| step (version) | greedy accuracy | maj@1 | maj@2 | maj@4 | maj@8 | maj@16 | pass@1 | pass@2 "
                      "| pass@4 | pass@8 | pass@16 | reward |"), header
    assert eval_table([row])[2] == ("| 4 | 0.500 | 0.025 | 0.050 | 0.100 | 0.200 | 0.400 | 0.050 | 0.100 | 0.200 "
                                    "| 0.400 | 0.800 | 0.500 |")


def test_sampled_pass_at_1_is_shown_without_eval_before():
    summary = {"steps": 8, "eval_before": None, "eval_after": {"accuracy": 0.25, "pass_at_k": {"1": 0.375}}}
    lines = summary_table(summary)
    assert "| held-out sampled pass@1 before → after | None → 0.375 |" in lines, lines
    assert not [line for line in summary_table({"steps": 8, "eval_after": {"accuracy": 0.25}}) if "sampled" in line]
