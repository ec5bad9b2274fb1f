"""bench/off_policy_replay.py's warm-start cache: read back only for the settings that made it."""

import types

import numpy as np

from grpo_stream.bench import off_policy_replay
from grpo_stream.bench.off_policy_replay import demo_config, warm_started


def test_a_cached_warm_start_of_other_settings_is_not_read_back(monkeypatch, tmp_path):
    """The cache (--cache, one default path for every run) was read back whatever config made it: a run with
    another warm start (more steps, another seed, another model) silently started from the cached one."""
    made = []

    def fake_warm_start(model, params, task, tokenizer, cfg):  # the params tell which settings made them
        made.append((cfg.warmstart.steps, cfg.run.seed))
        return {"w": params["w"] + cfg.warmstart.steps + 100 * cfg.run.seed}, {}

    monkeypatch.setattr(off_policy_replay, "warm_start", fake_warm_start)
    parts = types.SimpleNamespace(model=types.SimpleNamespace(params={"w": np.zeros(3, np.float32)}), task=None,
                                  tokenizer=None)
    cache = tmp_path / "warm.npz"
    one, three = demo_config("warmstart.steps=1"), demo_config("warmstart.steps=3")
    assert warm_started(one, parts, cache)["w"].tolist() == [1, 1, 1]
    assert warm_started(three, parts, cache)["w"].tolist() == [3, 3, 3]  # made anew, not the 1-step one
    assert warm_started(three, parts, cache)["w"].tolist() == [3, 3, 3] and made == [(1, 0), (3, 0)]  # cached
    assert warm_started(demo_config("warmstart.steps=3", "run.seed=1"), parts, cache)["w"].tolist() == [103] * 3
    # a setting the warm start does not read (the RL objective) keeps the cache
    assert warm_started(demo_config("warmstart.steps=3", "run.seed=1", "algo.loss_algo=gspo-token"), parts,
                        cache)["w"].tolist() == [103] * 3 and len(made) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm.npz"]  # written whole, then renamed
