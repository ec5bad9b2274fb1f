"""summary.json's group counts after a stop: groups trained but not yet acknowledged (their checkpoint window) are
trained, named as such, not 'left in the buffer' as the stream's length alone would say."""

import json
import types

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.reports.run_outputs import write_summary
from grpo_stream.up.summary import done_line

COUNTERS = {"ingested": 30, "trained": 0, "dropped_stale": 0, "dropped_invalid": 0, "dropped_filtered": 0,
            "dropped_duplicate": 0, "refused_invalid": 0, "refused_duplicate": 0, "refused_full": 0, "depth": 30}


def test_a_stopped_run_counts_its_unacknowledged_groups_as_trained(tmp_path):
    # a run stopped after 7 steps of 4 groups: 28 trained, held until the checkpoint after theirs is safe; 2 waiting
    samplers = types.SimpleNamespace(groups_generated=lambda: 30, installed={})
    publisher = types.SimpleNamespace(samplers=samplers, published=[], publish_seconds=[])
    durability = types.SimpleNamespace(epoch="e1", checkpointed=[6], held=lambda: 28)
    summary = write_summary(tmp_path / "summary.json", load_config(None, []), steps=7, counters=COUNTERS,
                            by_sampler={}, publisher=publisher, durability=durability,
                            agreement={"tokens": 0, "abs_sum": 0.0, "max_abs": 0.0}, mesh_shape={}, final_weights=None,
                            carried={"warmstart": None, "eval_before": None}, eval_after=None, rl_seconds=1.0,
                            started=0.0, resumed_from=None, trained_here=28)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (summary["groups_trained"], summary["groups_trained_unacknowledged"], summary["groups_left_in_buffer"]) \
        == (28, 28, 2)
    assert summary["groups_ingested"] == summary["groups_trained"] + summary["groups_left_in_buffer"]
    assert "= trained 28 (28 not yet acknowledged) + dropped 0 + left 2;" in done_line(
        {**summary, "wall_seconds": 3.0}, tmp_path / "summary.json")
