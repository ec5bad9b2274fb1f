"""tracking.wandb: off by default, strict, and a W&B run that cannot be created is refused while parsing, naming
the field and the fix."""

import pytest

from grpo_stream.common.config.describe import describe
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError, RunConfig

ON = ["tracking.wandb.enabled=true", "tracking.wandb.project=grpo-stream-test"]


def test_wandb_is_off_by_default_and_an_empty_or_null_section_means_off(tmp_path):
    assert load_config(None).tracking.wandb.enabled is False
    path = tmp_path / "c.yaml"
    path.write_text("tracking:\n  wandb:\n")  # the section left empty reads as null
    assert load_config(path).tracking.wandb.enabled is False


def test_an_enabled_run_takes_its_settings():
    w = load_config(None, [*ON, "tracking.wandb.mode=offline", "tracking.wandb.entity=team", "tracking.wandb.group=g",
                           "tracking.wandb.dir=/tmp/wb", "tracking.wandb.samples_every=0"]).tracking.wandb
    assert (w.project, w.mode, w.entity, w.group, w.name, w.dir, w.samples_every, w.samples_max_rows) == (
        "grpo-stream-test", "offline", "team", "g", None, "/tmp/wb", 0, 64)


@pytest.mark.parametrize("overrides, message", [
    (["tracking.wandb.enabled=true"], "tracking.wandb.project: empty while tracking.wandb.enabled=true; name the W&B "
     "project the runs go to (e.g. tracking.wandb.project=grpo-stream), or set tracking.wandb.enabled=false"),
    (["tracking.wandb.enabled=true", "tracking.wandb.project=' '"], "tracking.wandb.project: empty while"),
    ([*ON, "tracking.wandb.project=team/runs"], "tracking.wandb.project: 'team/runs' holds '/', which W&B refuses "
     "in a project name"),
    ([*ON, "tracking.wandb.projet=x"], "tracking.wandb.projet: unknown key; did you mean tracking.wandb.project?"),
    (["tracking.neptune.enabled=true"], "tracking.neptune: unknown key"),
    ([*ON, "tracking.wandb.mode=disabled"], "tracking.wandb.mode: Input should be 'online' or 'offline'"),
    ([*ON, "tracking.wandb.samples_max_rows=0"], "tracking.wandb.samples_max_rows: Input should be greater than or "
     "equal to 1"),
    ([*ON, "tracking.wandb.samples_every=-1"], "tracking.wandb.samples_every: Input should be greater than or "
     "equal to 0"),
])
def test_a_bad_wandb_setting_is_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_describe_documents_every_wandb_field():
    text = describe(RunConfig, "tracking.wandb.")
    for name in ("enabled", "project", "entity", "mode", "group", "name", "dir", "samples_every", "samples_max_rows"):
        assert f"tracking.wandb.{name}: " in text
    assert "tracking.wandb.mode: 'online' | 'offline' = 'online'" in text
