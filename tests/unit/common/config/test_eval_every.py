"""eval.every_steps and eval.max_share: evaluation during RL (trainer_service/reports/in_run_eval.py)."""

import pathlib

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.trainer_service.plans import step_plan


def test_off_by_default_so_runs_evaluate_before_and_after_only():
    cfg = load_config(None, [])
    assert cfg.eval.every_steps == 0 and cfg.eval.max_share == 1.0
    assert not any(step_plan(cfg, s, batch=None).evaluate for s in range(1, cfg.trainer.steps + 1))


def test_every_steps_must_evaluate_published_versions():
    with pytest.raises(ConfigError, match=r"eval\.every_steps=3 is not a multiple of trainer\.publish_every=2.*"
                                          r"e\.g\. 2"):
        load_config(None, ["trainer.publish_every=2", "trainer.max_staleness=2", "eval.every_steps=3"])
    assert load_config(None, ["trainer.publish_every=2", "eval.every_steps=4"]).eval.every_steps == 4


def test_refused_on_a_multi_process_trainer_naming_the_fix():
    with pytest.raises(ConfigError, match=r"eval\.every_steps.*trainer\.processes=2.*eval\.every_steps=0"):
        load_config(None, ["trainer.processes=2", "trainer.mesh.fsdp=2", "eval.every_steps=5"])


@pytest.mark.parametrize("bad", ["eval.every_steps=-1", "eval.max_share=0", "eval.max_share=1.5"])
def test_limits_name_the_field(bad):
    with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")) as err:
        load_config(None, [bad])
    assert "unknown key" not in str(err.value)  # refused by its limit, as a field the section has


def test_unknown_key_in_the_section_is_refused():
    with pytest.raises(ConfigError, match=r"eval\.every_step: unknown key"):
        load_config(None, ["eval.every_step=2"])


@pytest.mark.parametrize("eval_after, expected", [(True, [2, 4, 6]), (False, [2, 4, 6, 8])])
def test_due_steps(eval_after, expected):
    """Every every_steps-th step; the last one is eval_after's when that runs (not evaluated twice)."""
    cfg = load_config(None, ["trainer.steps=8", "eval.every_steps=2", f"trainer.eval_after={str(eval_after).lower()}"])
    assert [s for s in range(1, 9) if step_plan(cfg, s, batch=None, group_index=np.zeros(1)).evaluate] == expected


def test_shipped_demo_evaluates_during_the_run():
    """The demo's report shows held-out accuracy every N steps (issue 59)."""
    cfg = load_config(pathlib.Path(__file__).resolve().parents[4] / "configs" / "tiny_arith.yaml")
    assert 0 < cfg.eval.every_steps < cfg.trainer.steps

