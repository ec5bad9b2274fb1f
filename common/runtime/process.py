"""Process start-up shared by the services: logging, CPU pinning, tensorboardX without torch, stopping on signals.
(What a process builds from its config, and JAX's compilation cache: common/assembly/.)"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import json
import logging
import os
import signal
import sys
import threading
from typing import Callable

from grpo_stream.common.runtime.console import show_detail


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
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if available is None:
        raise ValueError(f"{field}: CPU pinning needs Linux sched_setaffinity; set it to null on this system")
    unknown = sorted(set(cpus) - set(available))
    if unknown:
        raise ValueError(f"{field}={cpus}: cores {unknown} are not available to this process (it may use "
                         f"{available}); pick from those or set null")
    os.sched_setaffinity(0, set(cpus))


def import_tensorboardx_without_torch() -> None:
    """Import tensorboardX (Tunix's model packages import it) with torch hidden. When torch is installed,
    tensorboardX imports it at once only to accept torch tensors, which costs 1.5-4 s at each process start; these
    processes log numpy and floats. torch stays importable for whatever asks for it later."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        import tensorboardX  # noqa: F401, PLC0415 - deferred: only torch hidden, and only once
    finally:
        del sys.modules["torch"]


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")  # SIGHUP: a closed terminal or ssh session stops, never kills
_STOPPED_WHILE_STARTING = threading.Event()


def hold_stop_signals() -> None:
    """From a service process's start until its loop calls stop_on_signals: a stop signal is kept, and the loop
    stops as soon as it starts. SIGTERM's default killed the process (-15 in summary.json) when `up` was stopped while
    a sampler still imported JAX. A second signal meanwhile ends it at once (130), as a second Ctrl-C does."""
    def _held(_signum, _frame):
        if _STOPPED_WHILE_STARTING.is_set():
            raise KeyboardInterrupt  # the CLI's 130
        _STOPPED_WHILE_STARTING.set()

    for name in STOP_SIGNALS:
        signum = getattr(signal, name)
        if not (name == "SIGHUP" and signal.getsignal(signum) == signal.SIG_IGN):  # nohup: stays ignored
            signal.signal(signum, _held)


def stop_on_signals(stop_event, what: str) -> None:
    """SIGTERM, SIGINT and SIGHUP set `stop_event`: the process finishes `what` and exits cleanly (every retry loop
    waits on the same event, so a stop is not held up by a dependency that is down). A stop signal held since the
    process started (hold_stop_signals) sets it at once."""
    log = logging.getLogger("grpo_stream.signals")

    def _stop(signum, _frame):
        log.warning("signal %d: finishing the current %s, then stopping", signum, what)
        stop_event.set()

    for name in STOP_SIGNALS:
        signum = getattr(signal, name)
        if name == "SIGHUP" and signal.getsignal(signum) == signal.SIG_IGN:
            continue  # started under nohup: logging out must not stop it
        signal.signal(signum, _stop)
    if _STOPPED_WHILE_STARTING.is_set():
        log.warning("a stop signal came while the process started: stopping before the first %s", what)
        stop_event.set()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl():
    """libc's prctl, resolved now (in the parent): a child between fork and exec must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # int prctl(int, unsigned long, ...)
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits; False where it cannot."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent_pid: int | None = None) -> Callable[[], None]:
    """A Popen preexec_fn for a helper process (`up`'s children, an embedded redis-server) that must not outlive
    the one that started it: the kernel sends it SIGKILL when the starting *thread* exits (PR_SET_PDEATHSIG; where
    prctl does not exist, nothing), and it kills itself at once if the parent (`parent_pid`, default: the caller)
    was already gone before the signal was armed (it would never come)."""
    parent = os.getpid() if parent_pid is None else parent_pid

    def _in_child() -> None:
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    return _in_child
