"""Process start-up shared by the services: logging, the compilation cache, the task and the tokenizer of a run."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import shutil
import sys
import tempfile

from grpo_stream.common.tasks.registry import build_task_for
from grpo_stream.common.runtime.console import show_detail
from grpo_stream.common.runtime.private_dir import fix_hint, make_private_dir
from grpo_stream.common.config.process import COMPILATION_CACHE_ENV, default_compilation_cache_dir
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.common.model.tokenizer import TextTokenizer, train_bpe

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


def setup_logging(level: str, process: str, fmt: str = "text", verbose: bool = False) -> None:
    """Console logging of every process; `verbose` (logging.verbose, `-v`) lets the detail lines through."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonLineFormatter(process) if fmt == "json" else logging.Formatter(
        f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    show_detail(verbose, level)


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


# Cache every program, however fast it compiled (JAX's default skips those under 1 s). Measured on the smoke
# config's `eval` (2 cores): 28 programs took 5 ms to 2.6 s each to compile, 7 s in all, and reading one back
# takes a few ms, so even the small ones pay off; and with a time threshold, which programs get cached would
# depend on how busy the machine was, so a restarted process could still compile some of them.
CACHE_MIN_COMPILE_SECONDS = 0.0
# -1 also stops JAX from raising the size floor for some filesystems: every entry is written.
CACHE_MIN_ENTRY_BYTES = -1


def compilation_cache_dir(cfg: RunConfig) -> str | None:
    """runtime.compilation_cache_dir, created (0700) and checked writable and private; None when disabled.

    A directory that was asked for (the config or $GRPO_STREAM_COMPILATION_CACHE_DIR) and cannot be written raises
    ValueError naming the field: the user expects the cache, and JAX itself would only warn once per program. The
    built-in default (under the user's cache directory, e.g. a read-only home in a container) logs a warning and
    the process runs without the cache. A compiled program is loaded as code, so a directory another user owns or
    may write (common/runtime/private_dir.py) is not used: the process compiles into a private temporary directory
    (removed at exit) and logs why, with the fix. Imports no JAX, so `up` checks it before it starts any process.
    """
    path = cfg.runtime.compilation_cache_dir
    if path is None:
        return None
    try:
        reason = make_private_dir(path)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        default = os.path.normpath(os.path.expanduser(default_compilation_cache_dir()))
        from_env = bool(os.environ.get(COMPILATION_CACHE_ENV)) and path == default
        problem = (f"runtime.compilation_cache_dir={path}{f' (from ${COMPILATION_CACHE_ENV})' if from_env else ''}: "
                   f"cannot create or write it ({type(exc).__name__}: {exc})")
        if path == default and not from_env:
            logging.getLogger("grpo_stream.runtime").warning("%s; compiling without a persistent cache (set the "
                                                             "field to a writable directory, or none)", problem)
            return None
        raise ValueError(f"{problem}; choose a writable directory, or set runtime.compilation_cache_dir=none to "
                         "compile without a cache") from None
    if reason is not None:
        private = tempfile.mkdtemp(prefix="grpo-stream-jax-cache-")  # 0700, this user's
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        logging.getLogger("grpo_stream.runtime").warning(
            "runtime.compilation_cache_dir=%s is not private to this user: %s. Compiled programs are not loaded from "
            "it; this process caches in %s (removed at exit) instead; %s", path, reason, private, fix_hint(path))
        return private
    return path


@dataclasses.dataclass
class CompilationCacheStats:
    """What JAX's persistent cache did in this process: programs looked up, loaded, compiled and written."""

    directory: str | None
    lookups: int = 0
    hits: int = 0
    writes: int = 0

    def _on_event(self, event: str, **_kwargs) -> None:
        # '.../cache_misses' is recorded when an entry is written (jax/_src/compilation_cache.py)
        if event == "/jax/compilation_cache/compile_requests_use_cache":
            self.lookups += 1
        elif event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.writes += 1

    def summary(self) -> str:
        if self.directory is None:
            return "compilation cache off"
        return (f"compilation cache {self.directory}: {self.hits} of {self.lookups} programs loaded, "
                f"{self.writes} compiled and written")


def import_tensorboardx_without_torch() -> None:
    """Import tensorboardX (Tunix's model packages import it) with torch hidden. When torch is installed,
    tensorboardX imports it at once only to accept torch tensors, which costs 1.5-4 s at each process start; these
    processes log numpy and floats. torch stays importable for whatever asks for it later."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        import tensorboardX  # noqa: F401, PLC0415
    finally:
        del sys.modules["torch"]


def enable_compilation_cache(cfg: RunConfig) -> CompilationCacheStats:
    """Point JAX's persistent compilation cache at runtime.compilation_cache_dir (or turn it off), before the first
    compilation. Returns the counts of this process's cache use, which the entry point logs at the end."""
    import jax  # noqa: PLC0415 - entry points parse the config before JAX loads
    from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415

    stats = CompilationCacheStats(compilation_cache_dir(cfg))
    if jax.config.jax_compilation_cache_dir != stats.directory:
        jax.config.update("jax_compilation_cache_dir", stats.directory)
        compilation_cache.reset_cache()  # a cache JAX already opened keeps its directory otherwise
    if stats.directory is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", CACHE_MIN_ENTRY_BYTES)
        jax.monitoring.register_event_listener(stats._on_event)
    return stats


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
    hf_tokenizer = None
    if cfg.model.kind == "hf":
        from grpo_stream.common.model.hf_checkpoint import read_architecture, resolve_model_dir  # noqa: PLC0415
        from grpo_stream.common.model.tokenizer import HFTokenizer  # noqa: PLC0415

        directory = resolve_model_dir(cfg.model.path)
        arch = read_architecture(directory)
        hf_tokenizer = HFTokenizer(directory, cfg.model.pad_token, vocab_size=arch.vocab_size)
    return build_task_for(cfg, hf_tokenizer)


def build_policy(cfg: RunConfig, vocab_size: int, seed: int | None, dtype: str | None = None):
    """The policy model: tiny (random init from `seed`) or the checkpoint at model.path; abstract when seed is None
    (samplers receive every weight from the trainer), in `dtype` when given (the samplers': cfg.sampler_dtype())
    instead of model.dtype."""
    from grpo_stream.common.model import policy as model_lib  # noqa: PLC0415

    dtype = dtype or cfg.model.dtype
    if cfg.model.kind == "tiny":
        return model_lib.build_model(cfg.model, vocab_size, seed, dtype)
    import jax.numpy as jnp  # noqa: PLC0415

    from grpo_stream.common.model.hf_checkpoint import read_architecture, resolve_model_dir  # noqa: PLC0415

    directory = resolve_model_dir(cfg.model.path)
    if seed is None:
        return model_lib.build_from_architecture(read_architecture(directory), None,
                                                 jnp.float32 if dtype == "float32" else jnp.bfloat16)
    return model_lib.load_hf_model(str(directory), dtype)


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")  # SIGHUP: a closed terminal or ssh session stops, never kills


def stop_on_signals(stop_event, what: str) -> None:
    """SIGTERM, SIGINT and SIGHUP set `stop_event`: the process finishes `what` and exits cleanly (every retry loop
    waits on the same event, so a stop is not held up by a dependency that is down)."""
    import signal

    log = logging.getLogger("grpo_stream.signals")

    def _stop(signum, _frame):
        log.warning("signal %d: finishing the current %s, then stopping", signum, what)
        stop_event.set()

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), _stop)
