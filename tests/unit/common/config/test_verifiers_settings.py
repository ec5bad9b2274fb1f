"""task.verifiers.sampling_args: what the endpoint would serve but the run's rollouts cannot use is refused when the
config loads, naming the argument (common/config/verifiers_settings.py)."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError

BASE = ["task.name=verifiers", "task.verifiers.environment=vf-x"]


@pytest.mark.parametrize("override, named", [
    # each of a group's rollouts sends its own request: with one seed they all drew the same tokens (tested against
    # the real endpoint: 1 distinct completion of 4 per problem), so the group had no advantage and pass@k was pass@1
    ("task.verifiers.sampling_args.seed=7", r"seed=7: every rollout of a group"),
    ("task.verifiers.sampling_args.extra_body.seed=7", r"seed=7: every rollout of a group"),  # sent at the top too
    ("task.verifiers.sampling_args.n=2", r"n=2: .*need n=1"),
    ("task.verifiers.sampling_args.logprobs=false", r"logprobs=False: .*need logprobs=True"),
    ("task.verifiers.sampling_args.stream=true", r"stream=True: .*need stream=False"),
])
def test_sampling_args_that_break_the_rollouts_are_refused_naming_them(override, named):
    with pytest.raises(ConfigError, match=r"task\.verifiers\.sampling_args: " + named):
        load_config(None, [*BASE, override])


def test_sampling_args_the_rollouts_can_use_are_kept():
    cfg = load_config(None, [*BASE, "task.verifiers.sampling_args.max_tokens=32", "task.verifiers.sampling_args.n=1",
                             "task.verifiers.sampling_args.logprobs=true"])
    assert cfg.task.verifiers.sampling_args == {"max_tokens": 32, "n": 1, "logprobs": True}
