"""Target checks and the markdown results table of `grpo-stream bench`."""

from grpo_stream.bench.runner import TABLE_HEADER, append_row, check_targets, table_row


def test_targets_compare_in_the_right_direction():
    met = check_targets("transport", {"ratio_vs_json": 5.0, "fraction_of_raw_redis": 0.2})
    assert met["ratio_vs_json"]["met"] and not met["fraction_of_raw_redis"]["met"]
    assert met["fraction_of_raw_redis"]["target"] == ">= 0.25"
    assert check_targets("pipeline", {"overhead_share": 0.04})["overhead_share"]["met"]
    met = check_targets("async", {"async_over_sync": 0.85,
                                  "generation_wasted_fraction": {"async": 0.01, "sync": 0.2}})
    assert not met["async_over_sync"]["met"] and met["generation_wasted_fraction.async"]["met"]
    assert not met["generation_wasted_fraction.sync"]["met"]


def test_table_gets_one_header_and_a_row_per_result(tmp_path):
    table = tmp_path / "sub" / "results.md"
    result = {"longtail": {"ratio_vs_static": 9.0, "ratio_vs_vllm": 0.5}, "fixed": {"ratio_vs_vllm": 0.9,
                                                                                     "ratio_vs_hf": 3.1}}
    ok = {"quick": False, "seconds": 12.5, "targets": check_targets("sampler", result)}
    append_row(table, table_row("sampler", ok, "2026-11-22 10:00", "abc1234"))
    append_row(table, table_row("async", {"quick": True, "error": "RuntimeError: boom", "seconds": 1.0},
                                "2026-11-22 10:05", "abc1234"))
    text = table.read_text()
    assert text.count(TABLE_HEADER) == 1
    rows = text.splitlines()[-2:]
    assert rows[0] == ("| 2026-11-22 10:00 | abc1234 | sampler | full | longtail.ratio_vs_static 9.0, "
                       "longtail.ratio_vs_vllm 0.5, fixed.ratio_vs_vllm 0.9, fixed.ratio_vs_hf 3.1 | 3/4 | 12.5 |")
    assert rows[1] == "| 2026-11-22 10:05 | abc1234 | async | quick | RuntimeError: boom | error | 1.0 |"
