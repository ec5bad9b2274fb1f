"""Process start-up shared by the services: logging, the task and the tokenizer of a run."""

from __future__ import annotations

import datetime
import json
import logging
import sys

from common.config import RunConfig
from common.tasks.arith import ArithTask
from common.tokenizer import TextTokenizer, train_bpe

TOKENIZER_CORPUS_SIZE = 4000


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record, for log collectors (logging.format=json)."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                   timespec="milliseconds"),
               "process": self.process, "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str, process: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonLineFormatter(process) if fmt == "json" else logging.Formatter(
        f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def pin_to_cpus(cpus: list[int] | None, field: str) -> None:
    """Restrict this process to `cpus` (from config `field`) before JAX starts its thread pools."""
    if cpus is None:
        return
    import os

    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if available is None:
        raise ValueError(f"{field}: CPU pinning needs Linux sched_setaffinity; set it to null on this system")
    unknown = sorted(set(cpus) - set(available))
    if unknown:
        raise ValueError(f"{field}={cpus}: cores {unknown} are not available to this process (it may use "
                         f"{available}); pick from those or set null")
    os.sched_setaffinity(0, set(cpus))


def build_task(cfg: RunConfig) -> ArithTask:
    t = cfg.task
    return ArithTask(t.min_operand, t.max_operand, t.heldout_fraction, cfg.run.seed)


def build_tokenizer(cfg: RunConfig, task: ArithTask) -> TextTokenizer:
    """The tiny model's tokenizer, trained deterministically on the task's text (same in every process)."""
    return train_bpe(task.corpus(TOKENIZER_CORPUS_SIZE), cfg.model.tiny.vocab_size)


def build_task_and_tokenizer(cfg: RunConfig):
    """(task, tokenizer) of a run, built the same way in every process.

    The tokenizer is the checkpoint's (model.kind=hf) or a BPE trained on the
    task's own text (tiny model); GSM8K prompts are rendered with it
    (task.prompt_template).
    """
    from common import prompts  # noqa: PLC0415

    hf_tokenizer = None
    if cfg.model.kind == "hf":
        from common.hf_checkpoint import read_architecture, resolve_model_dir  # noqa: PLC0415
        from common.tokenizer import HFTokenizer  # noqa: PLC0415

        directory = resolve_model_dir(cfg.model.path)
        arch = read_architecture(directory)
        hf_tokenizer = HFTokenizer(directory, cfg.model.pad_token, vocab_size=arch.vocab_size)
    if cfg.task.name == "arith":
        task = build_task(cfg)
        return task, hf_tokenizer or build_tokenizer(cfg, task)
    from common.tasks.gsm8k import Gsm8kTask, load_problems  # noqa: PLC0415

    d = cfg.task.dataset
    train, test = (load_problems(d.source, split, d.question_field, d.answer_field, d.on_bad_row, d.hub_config,
                                 d.limit) for split in (d.train_split, d.test_split))
    tokenizer = hf_tokenizer or train_bpe([f"{p.question} {p.solution}" for p in train[:TOKENIZER_CORPUS_SIZE]],
                                          cfg.model.tiny.vocab_size)
    return Gsm8kTask(train, test, lambda q: prompts.render(q, cfg.task.prompt_template, tokenizer),
                     cfg.run.seed), tokenizer


def build_policy(cfg: RunConfig, vocab_size: int, seed: int | None):
    """The policy model: tiny (random init from `seed`) or the checkpoint at model.path; abstract when seed is None
    (samplers receive every weight from the trainer)."""
    from common import model as model_lib  # noqa: PLC0415

    if cfg.model.kind == "tiny":
        return model_lib.build_model(cfg.model, vocab_size, seed)
    import jax.numpy as jnp  # noqa: PLC0415

    from common.hf_checkpoint import read_architecture, resolve_model_dir  # noqa: PLC0415

    directory = resolve_model_dir(cfg.model.path)
    if seed is None:
        dtype = jnp.float32 if cfg.model.dtype == "float32" else jnp.bfloat16
        return model_lib.build_from_architecture(read_architecture(directory), None, dtype)
    return model_lib.load_hf_model(str(directory), cfg.model.dtype)


def stop_on_signals(stop_event, what: str) -> None:
    """SIGTERM/SIGINT set `stop_event`: the process finishes `what` and exits cleanly."""
    import signal

    log = logging.getLogger("grpo_stream.signals")

    def _stop(signum, _frame):
        log.warning("signal %d: finishing the current %s, then stopping", signum, what)
        stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
