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


def stop_on_signals(stop_event, what: str) -> None:
    """SIGTERM/SIGINT set `stop_event`: the process finishes `what` and exits cleanly."""
    import signal

    log = logging.getLogger("grpo_stream.signals")

    def _stop(signum, _frame):
        log.warning("signal %d: finishing the current %s, then stopping", signum, what)
        stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
