"""What the trainer trains and publishes: the plain model's parameters, or LoRA adapters over a frozen base.

The core, the checkpoints and the publisher ask the policy instead of branching on model.lora: which model and
parameters the updater trains, the plain parameters that evaluation, export and samplers run (LoRA: merged,
W + alpha/rank A B), and what one published version carries (LoRA: the adapters only, after the frozen base once).
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.model.lora import LoraPolicy, apply_lora

log = logging.getLogger(__name__)


class PlainParams:
    """Every parameter is trained and every version carries all of them."""

    lora: LoraPolicy | None = None

    def trained(self, model, params) -> tuple[Any, Any, list[bool] | None]:
        """(model, params, trainable flags) the updater trains, from the plain `model` at `params`."""
        return model, params, None

    def plain(self, params) -> Any:
        return params

    def publish(self, publisher, model, version: int, params, final: bool):
        return publisher.publish_arrays(version, model.named_arrays(params), final=final)


class LoraParams(PlainParams):
    """model.lora: adapters on the frozen base; the base goes out once per trainer process, then adapters only."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.lora: LoraPolicy | None = None  # built around the plain params RL starts from (`trained`)
        self._base_published = False

    def trained(self, model, params):
        cfg = self.cfg
        self.lora = apply_lora(model, params, cfg.model.lora, cfg.run.seed)
        self._merge = jax.jit(self.lora.merged)
        self._adapter_version = self.lora.adapter_version()
        log.info("LoRA rank %d on %d weights: %d adapter parameters (%.2f%% of the model's) are trained",
                 cfg.model.lora.rank, len(self.lora.weights), self.lora.adapter_count(),
                 100 * self.lora.adapter_count() / model.num_params())
        return self.lora.adapted, self.lora.adapted.params, self.lora.trainable()

    def _adapted(self, params) -> bool:
        """Whether `params` are the adapted model's (base and adapters): before the adapters exist (warm start,
        eval_before) they are the plain model's."""
        return self.lora is not None and jax.tree.structure(params) != jax.tree.structure(self.lora.base.params)

    def plain(self, params):
        return self._merge(params) if self._adapted(params) else params

    def publish(self, publisher, model, version: int, params, final: bool):
        if not self._adapted(params):
            return super().publish(publisher, model, version, params, final)
        base, adapters = self.lora.split_named(params)
        if not self._base_published:
            publisher.publish_base(base)
            self._base_published = True
        return publisher.publish_arrays(version, adapters, final=final, adapters=self._adapter_version)


def params_policy(cfg: RunConfig) -> PlainParams:
    return PlainParams() if cfg.model.lora is None else LoraParams(cfg)
