"""The positions a compacted watermark passed over: which are holes, how a late group fills one, and the bound."""

from grpo_stream.common.rollouts import compaction_holes as holes


def test_the_gaps_a_watermark_jumps_over_are_holes():
    assert holes.passed_over(-1, [0, 1, 3, 7, 8]) == [(2, 2), (4, 6)]
    assert holes.passed_over(4, [2, 5, 9]) == [(6, 8)]  # 2 filled a hole below the old watermark
    assert holes.passed_over(-1, [0, 1, 2]) == []


def test_a_late_group_fills_its_hole_and_only_that_position():
    below, kept = {"s": 9}, {"s": holes.render([(2, 2), (4, 6)])}
    assert [holes.compacted_position(below, kept, "s", p) for p in (1, 2, 5, 9, 10, -1)] == [
        "dup", "hole", "hole", "dup", None, None]
    holes.fill_hole(kept, "s", 5)
    assert kept == {"s": "2-2,4-4,6-6"}
    for p in (2, 4, 6):
        holes.fill_hole(kept, "s", p)
    assert kept == {} and holes.compacted_position(below, kept, "s", 5) == "dup"


def test_compaction_keeps_the_newest_holes_and_never_restores_a_filled_one():
    many = [(2 * i, 2 * i) for i in range(holes.MAX_HOLES + 10)]
    kept = holes.parse(holes.updated(None, many, []))
    assert len(kept) == holes.MAX_HOLES and kept[-1] == many[-1] and kept[0] == many[10]
    assert holes.updated("3-5", [(9, 9)], [4]) == "3-3,5-5,9-9"
    assert holes.updated("3-3", [], [3]) == ""
