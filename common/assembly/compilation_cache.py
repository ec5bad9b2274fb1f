"""JAX's persistent compilation cache of a process (runtime.compilation_cache_dir): checked before JAX loads, then
turned on with counts of what it did."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import tempfile

from grpo_stream.common.config.process import COMPILATION_CACHE_ENV, default_compilation_cache_dir
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.private_dir import fix_hint, make_private_dir

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


def enable_compilation_cache(cfg: RunConfig) -> CompilationCacheStats:
    """Point JAX's persistent compilation cache at runtime.compilation_cache_dir (or turn it off), before the first
    compilation. Returns the counts of this process's cache use, which the entry point logs at the end."""
    import jax  # noqa: PLC0415 - deferred: entry points parse the config before JAX loads
    from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415 - deferred: as above

    stats = CompilationCacheStats(compilation_cache_dir(cfg))
    if jax.config.jax_compilation_cache_dir != stats.directory:
        jax.config.update("jax_compilation_cache_dir", stats.directory)
        compilation_cache.reset_cache()  # a cache JAX already opened keeps its directory otherwise
    if stats.directory is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", CACHE_MIN_ENTRY_BYTES)
        jax.monitoring.register_event_listener(stats._on_event)
    return stats
