"""The compaction decision (plan_compaction) leaves the trail alone where the audit must see something: an
evaluation-only answer listed in a step, a lineage step without a record; and it only folds what is final."""

import json

import pytest

from grpo_stream.common.rollouts.audit_compaction import lineage_windows, plan_compaction

TRAINER_A = [{"epoch": "a", "from_step": "0", "from_epoch": ""}]


def test_an_evaluation_only_answer_in_a_step_stops_compaction():
    accepted = {"g1": {"sampler": "s0", "position": 0}}
    settled = {"g1": {"outcome": "trained", "step": 1}}
    steps = [{"id": "1000-0", "epoch": "a", "step": "1", "groups": json.dumps(["g1", "e1"])}]
    plan = plan_compaction(1, 0, accepted, settled, {}, steps, TRAINER_A,
                           [{"epoch": "a", "step": "1"}], {"e1": {"t": 0.5}}, {})
    assert plan.through_step == 0 and not plan.group_ids and "evaluation-only" in plan.held_back


def test_a_step_without_a_record_stops_compaction():
    plan = plan_compaction(2, 0, {}, {}, {}, [{"id": "1-0", "epoch": "a", "step": "2", "groups": "[]"}],
                           TRAINER_A, [{"epoch": "a", "step": "2"}], {}, {})
    assert plan.through_step == 0 and "[1]" in plan.held_back


def test_only_groups_in_exactly_one_lineage_step_or_dropped_fold_and_the_watermark_stops_at_the_first_other():
    accepted = {f"g{p}": {"sampler": "s0", "position": p} for p in range(5)}
    settled = {"g0": {"outcome": "trained", "step": 1}, "g1": {"outcome": "dropped_stale", "step": 1},
               "g2": {"outcome": "trained", "step": 1}, "g4": {"outcome": "trained", "step": 2}}
    # g2 is listed twice (trained twice: the audit must see it); g3 waits; g4 is in a step after through_step
    steps = [{"id": "1000-0", "epoch": "a", "step": "1", "groups": json.dumps(["g0", "g2", "g2"])},
             {"id": "2000-0", "epoch": "a", "step": "2", "groups": json.dumps(["g4"])}]
    plan = plan_compaction(1, 0, accepted, settled, {"g1": 2}, steps, TRAINER_A, [{"epoch": "a", "step": "2"}], {}, {})
    # step 1's record stays (it lists g2, which stays), so g0, which it lists too, stays with it (the audit counts
    # every group a kept record lists); and the watermark stops there
    assert plan.through_step == 1 and plan.group_ids == [] and plan.below == {} and plan.step_records == []
    steps[0]["groups"] = json.dumps(["g0"])  # g2 was never trained: step 1 holds g0 alone
    plan = plan_compaction(1, 0, accepted, settled, {"g1": 2}, steps, TRAINER_A, [{"epoch": "a", "step": "2"}], {}, {})
    assert plan.group_ids == ["g0", "g1"] and plan.below == {"s0": 1} and plan.step_records == ["1000-0"]
    counts = plan.counts
    assert counts["trained"] == 1 and counts["dropped_stale"] == 1 and counts["second_copies_dropped"] == 2


def test_a_step_whose_groups_straddle_a_watermark_goes_whole_or_not_at_all():
    """Samplers send groups as they end, out of data-position order: step 1 trains s0's positions 0 and 2 while
    position 1 still decodes. Position 2 cannot fold (the watermark stops at 1), so neither does 0: the step's record
    stays and lists only groups the audit still finds accepted. Once position 1 is trained (step 2), all go."""
    accepted = {f"g{p}": {"sampler": "s0", "position": p} for p in range(3)}
    settled = {"g0": {"outcome": "trained", "step": 1}, "g2": {"outcome": "trained", "step": 1}}
    steps = [{"id": "1000-0", "epoch": "a", "step": "1", "groups": json.dumps(["g0", "g2"])}]
    plan = plan_compaction(1, 0, accepted, settled, {}, steps, TRAINER_A, [{"epoch": "a", "step": "1"}], {}, {})
    assert plan.group_ids == [] and plan.step_records == [] and plan.below == {}
    settled["g1"] = {"outcome": "trained", "step": 2}
    steps.append({"id": "2000-0", "epoch": "a", "step": "2", "groups": json.dumps(["g1"])})
    plan = plan_compaction(2, 0, accepted, settled, {}, steps, TRAINER_A, [{"epoch": "a", "step": "2"}], {}, {})
    assert plan.group_ids == ["g0", "g1", "g2"] and plan.below == {"s0": 2}
    assert sorted(plan.step_records) == ["1000-0", "2000-0"]


def test_trainer_starts_that_resume_in_a_circle_are_an_error_not_an_endless_loop():
    """Only a hand-edited trail resumes in a circle (a from b, b from a); following it looped forever, in the
    trainer's compaction at every acknowledged checkpoint and in `audit`."""
    trainers = [{"epoch": "a", "from_step": "2", "from_epoch": "b"},
                {"epoch": "b", "from_step": "1", "from_epoch": "a"}]
    with pytest.raises(ValueError, match="resume in a circle through trainer b"):
        lineage_windows(trainers, [])
    plan = plan_compaction(1, 0, {}, {}, {}, [], trainers, [], {}, {})
    assert plan.through_step == 0 and "circle" in plan.held_back
