"""The config section of task.name=verifiers: which `verifiers` environment a run trains on, with what arguments
(common/tasks/verifiers_task.py; docs/verifiers.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from grpo_stream.common.config.base import Strict


class VerifiersSection(Strict):
    environment: str | None = Field(None, min_length=1, max_length=256, description="task.name=verifiers: the "
                                    "environment's id or module, as `vf.load_environment` takes it (an installed "
                                    "environment package, e.g. 'vf-gsm8k', or an importable module defining "
                                    "load_environment(**args)). Chosen by whoever writes the config, like any "
                                    "code the run imports.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of load_environment.")
    sampling_args: dict[str, Any] = Field(default_factory=dict, description="Extra sampling arguments of every "
                                          "model call (merged over the run's: temperature generation.temperature, "
                                          "max_tokens environment.turn_max_new_tokens or generation.max_new_tokens, "
                                          "logprobs and return_token_ids on); what the samplers' endpoint cannot "
                                          "serve is refused there, naming the field.")
    group_timeout_s: float = Field(1800.0, gt=0, le=86_400, description="Wall time one group's `run_group` may "
                                   "take (its model calls, its tools and its rubric). Past it the group is cancelled "
                                   "and its rollouts fail, so an environment that hangs cannot hold the sampler's "
                                   "rows for ever; a blocking call that never yields to the event loop cannot be "
                                   "cancelled this way.")
    eval_split: bool = Field(True, description="Held-out problems come from the environment's eval dataset "
                             "(get_eval_dataset); False: from the end of its training dataset.")
