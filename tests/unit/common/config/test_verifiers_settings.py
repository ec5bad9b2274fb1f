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
    cfg = load_config(None, [*BASE, "generation.max_new_tokens=32", "task.verifiers.sampling_args.max_tokens=32",
                             "task.verifiers.sampling_args.n=1", "task.verifiers.sampling_args.logprobs=true",
                             "generation.temperature=0.7", "task.verifiers.sampling_args.temperature=0.7",
                             "task.verifiers.sampling_args.top_p=1"])
    assert cfg.task.verifiers.sampling_args == {"max_tokens": 32, "n": 1, "logprobs": True, "temperature": 0.7,
                                                "top_p": 1}


@pytest.mark.parametrize("override, named", [
    ("task.verifiers.sampling_args.temperature=0.7", r"temperature=0.7 differs from generation.temperature=1.0: the "
                                                      r"samplers' endpoint refuses every other"),
    ("task.verifiers.sampling_args.extra_body.temperature=0", r"temperature=0 differs from generation.temperature=1.0:"
                                                              r" every rollout of a group would decode greedily"),
    ("task.verifiers.sampling_args.max_tokens=17", r"max_tokens=17 exceeds generation.max_new_tokens=16"),
    ("task.verifiers.sampling_args.max_completion_tokens=64", r"max_completion_tokens=64 exceeds generation"),
    ("task.verifiers.sampling_args.top_p=0.9", r"top_p=0.9: the samplers' endpoint samples the whole distribution"),
])
def test_sampling_args_the_endpoint_refuses_on_every_call_are_refused_at_load_naming_both_fields(override, named):
    """The samplers' endpoint answers each such model call 400 (common/endpoint/protocol.py): every group's rollouts
    failed, and the sampler stopped after MAX_FAILED_IN_A_ROW failed groups, once the run had loaded its model and
    started; and outside a verifiers run sampling_args are not sent, so they are not judged."""
    with pytest.raises(ConfigError, match=r"task\.verifiers\.sampling_args\." + named):
        load_config(None, [*BASE, override])
    assert load_config(None, [override]).task.name == "arith"
