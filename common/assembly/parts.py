"""The parts every process of a run builds the same way from its config: the task and its tokenizer, the policy."""

from __future__ import annotations

import contextlib
from typing import Iterator

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.model.tokenizer import HFTokenizer
from grpo_stream.common.runtime.errors import SetupError
from grpo_stream.common.tasks.registry import build_task_for


@contextlib.contextmanager
def _setup() -> Iterator[None]:
    """A ValueError building a run's parts from the config and its files is a SetupError: a process exits 3 on it and
    `up` stops the run naming it, instead of restarting every process into the same error."""
    try:
        yield
    except SetupError:
        raise
    except ValueError as exc:
        raise SetupError(str(exc)) from exc


def build_task_and_tokenizer(cfg: RunConfig):
    """(task, tokenizer) of a run, built the same way in every process.

    The tokenizer is the checkpoint's (model.kind=hf) or a BPE trained on the
    task's own text (tiny model); GSM8K prompts are rendered with it
    (task.prompt_template). A config or file they cannot be built from raises SetupError.
    """
    with _setup():
        return _task_and_tokenizer(cfg)


def _task_and_tokenizer(cfg: RunConfig):
    hf_tokenizer = None
    if cfg.model.kind == "hf":
        # deferred: the checkpoint code imports JAX, which a tiny model's task and tokenizer never need
        from grpo_stream.common.model.hf_checkpoint import read_architecture, resolve_model_dir  # noqa: PLC0415

        directory = resolve_model_dir(cfg.model.path)
        arch = read_architecture(directory)
        hf_tokenizer = HFTokenizer(directory, cfg.model.pad_token, vocab_size=arch.vocab_size,
                                   tool_format=cfg.environment.tool_format)
    return build_task_for(cfg, hf_tokenizer)


def build_policy(cfg: RunConfig, vocab_size: int, seed: int | None, dtype: str | None = None, mesh=None):
    """The policy model: tiny (random init from `seed`) or the checkpoint at model.path; abstract when seed is None
    (samplers receive every weight from the trainer), in `dtype` when given (the samplers': cfg.sampler_dtype())
    instead of model.dtype. A checkpoint is read straight onto `mesh` when given (each device its slices: a 70B
    model never on one device). A checkpoint it cannot be built from raises SetupError."""
    with _setup():
        return _policy(cfg, vocab_size, seed, dtype, mesh)


def _policy(cfg: RunConfig, vocab_size: int, seed: int | None, dtype: str | None, mesh):
    from grpo_stream.common.model import policy as model_lib  # noqa: PLC0415 - deferred: JAX, after the config

    dtype = dtype or cfg.model.dtype
    if cfg.model.kind == "tiny":
        return model_lib.build_model(cfg.model, vocab_size, seed, dtype)
    import jax.numpy as jnp  # noqa: PLC0415 - deferred: JAX, after the config

    # deferred: JAX, after the config
    from grpo_stream.common.model.hf_checkpoint import read_architecture, resolve_model_dir  # noqa: PLC0415

    directory = resolve_model_dir(cfg.model.path)
    if seed is None:
        return model_lib.build_from_architecture(read_architecture(directory), None,
                                                 jnp.float32 if dtype == "float32" else jnp.bfloat16)
    return model_lib.load_hf_model(str(directory), dtype, mesh)
