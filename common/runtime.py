"""Process start-up shared by the services: logging, the task and the tokenizer of a run."""

from __future__ import annotations

import logging
import sys

from common.config import RunConfig
from common.tasks.arith import ArithTask
from common.tokenizer import TextTokenizer, train_bpe

TOKENIZER_CORPUS_SIZE = 4000


def setup_logging(level: str, process: str) -> None:
    logging.basicConfig(level=level, stream=sys.stdout, force=True,
                        format=f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


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
