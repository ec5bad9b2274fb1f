"""The config section of task.name=verifiers: which `verifiers` environment a run trains on, with what arguments
(common/tasks/verifiers_task.py; docs/verifiers.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

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
                                          "serve is refused there, naming the field. Not seed (every rollout of a "
                                          "group would draw the same tokens), n other than 1, logprobs false or "
                                          "stream true.")
    group_timeout_s: float = Field(1800.0, gt=0, le=86_400, description="Wall time one group's `run_group` may "
                                   "take (its model calls, its tools and its rubric). Past it the group is cancelled "
                                   "and its rollouts fail, so an environment that hangs cannot hold the sampler's "
                                   "rows for ever; a blocking call that never yields to the event loop cannot be "
                                   "cancelled this way.")
    eval_split: bool = Field(True, description="Held-out problems come from the environment's eval dataset (given "
                             "as a dataset or a builder), else from the last tenth of its training dataset, which the "
                             "run then never trains on; False: from that last tenth whatever it has.")

    @field_validator("sampling_args")
    @classmethod
    def _rollouts_stay_samples(cls, args: dict[str, Any]) -> dict[str, Any]:
        """Refuse what the endpoint would serve but that breaks the run: a seed makes each of a group's rollouts (one
        request each, the same prompt) draw the same tokens, so the group has no advantage and pass@k from the
        eval's samples is pass@1; n > 1 is refused per call by verifiers (one choice a call), logprobs off leaves
        the trainer nothing to weigh tokens by, and a streamed answer is not what verifiers' client reads."""
        body = args.get("extra_body")
        # verifiers' client sends extra_body's keys at the top of the request, over the others
        sent = {**{k: v for k, v in args.items() if k != "extra_body"}, **(body if isinstance(body, dict) else {})}
        if sent.get("seed") is not None:
            raise ValueError(f"seed={sent['seed']!r}: every rollout of a group would send the same request with the "
                             "same seed and draw the same tokens (no advantage to learn from, pass@k equal to "
                             "pass@1); leave seed out")
        for name, needed in (("n", 1), ("logprobs", True), ("stream", False)):
            if sent.get(name) is not None and sent[name] != needed:
                raise ValueError(f"{name}={sent[name]!r}: the run's rollouts need {name}={needed!r} (one choice a "
                                 "call, with its logprobs, answered whole); leave it out")
        return args


def sampling_problem(args: dict[str, Any], temperature: float, max_new_tokens: int) -> str | None:
    """Why task.verifiers.sampling_args cannot make the run's rollouts with generation.temperature=`temperature` and
    generation.max_new_tokens=`max_new_tokens` (naming both fields and the fix), or None. The samplers' endpoint
    refuses each such model call (common/endpoint/protocol.py), so every group's rollouts failed and the sampler
    stopped after its limit of failed groups, well into the run instead of when the config loaded."""
    body = args.get("extra_body")
    sent = {**{k: v for k, v in args.items() if k != "extra_body"}, **(body if isinstance(body, dict) else {})}
    asked = sent.get("temperature")
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and abs(asked - temperature) >= 1e-6:
        what = ("every rollout of a group would decode greedily, the same tokens (no advantage to learn from)"
                if asked == 0 else "the samplers' endpoint refuses every other (its logprobs are the policy's at "
                "that temperature), so every rollout would fail")
        return (f"task.verifiers.sampling_args.temperature={asked!r} differs from generation.temperature="
                f"{temperature}: {what}; leave it out (the run's temperature is sent) or set generation.temperature")
    for name in ("max_tokens", "max_completion_tokens"):
        budget = sent.get(name)
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > max_new_tokens:
            return (f"task.verifiers.sampling_args.{name}={budget} exceeds generation.max_new_tokens="
                    f"{max_new_tokens}, the most the samplers' endpoint serves (every rollout would fail); lower it, "
                    "leave it out, or raise generation.max_new_tokens")
    top_p = sent.get("top_p")
    if top_p is not None and top_p != 1:
        return (f"task.verifiers.sampling_args.top_p={top_p!r}: the samplers' endpoint samples the whole distribution "
                "(the policy whose logprobs the trainer weighs tokens by) and refuses any other top_p, so every "
                "rollout would fail; leave it out")
    return None
