"""Rewards run in a worker process with a deadline: a reward is the operator's code, but what it reads (the model's
completion, a dataset row's or an injected prompt's reference) is anyone's, and one pathological input (a regular
expression that backtracks for minutes, holding the GIL) must not freeze a sampler or the trainer's evaluation.

`RewardWorker.call(name, fn, text, reference)` is what `RewardSet.score` calls per reward: the worker process
(`python -m grpo_stream.common.tasks.reward_workers`, started on first use and again after a kill) resolves the
reward by name (a built-in, or an import path among the run's own `task.rewards`: nothing else is ever imported)
and answers with its value. A call that has not been sent and answered within `deadline_s`, or whose worker died on
it (killed for memory, a crash in native code), kills the worker and scores 0: logged once per reward name, counted
in `overruns`. A reward that raises is an error naming it, as in-process (RewardSet.score), its message cut to
MAX_ERROR_CHARS. `close()` kills the worker at once, a call in flight included (WorkerClosed: not scored). Messages are
length-prefixed JSON on the worker's stdin/stdout (nothing is unpickled), and the worker dies with the thread that
started it (PR_SET_PDEATHSIG) or when its stdin closes. The worker leads a process group of its own, and a kill
(deadline, close, restart) is sent to that whole group: what a reward started (`subprocess`, `multiprocessing`) dies
with it instead of outliving the sampler. A sampler killed with SIGKILL sends nothing, and PR_SET_PDEATHSIG ends the
worker alone (its children are re-parented to init): so the worker forks a keeper at its start, a member of the
group that runs no reward code and kills the group when the worker is gone (`_keep_group`). (A process a reward
starts in a session of its own leaves the group, and outlives the worker.) Its address space is capped at what it
maps once its rewards are imported plus `memory_mb` (RLIMIT_AS): a reward that allocates without bound on some
input gets a MemoryError, answered as a death (score 0, the worker restarted), instead of the host's OOM killer
choosing the sampler.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Iterable

from grpo_stream.common.runtime.process import set_parent_death_signal
from grpo_stream.common.tasks.ifeval_checks import lm_eval_ifeval
from grpo_stream.common.tasks.rewards import resolve

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<I")
KEEPER_POLL_S = 1.0  # where PR_SET_PDEATHSIG is missing, the keeper notices the worker's exit this late
STARTUP_S = 120.0  # a worker's start (imports, lm-eval for the IFEval rewards) is not held to a reward's deadline
DEFAULT_MEMORY_MB = 2048.0  # task.reward_memory_mb's default
MAX_ERROR_CHARS = 2000  # of a reward's error message, sent back (RewardSet.score keeps 300)
MAX_ANSWER_BYTES = 1 << 20  # a longer answer is a garbled stream: the worker is killed as dead


class RewardWorker:
    """One worker process scoring rewards for one thread at a time (calls are serialised by a lock)."""

    def __init__(self, allowed: Iterable[str], deadline_s: float, memory_mb: float | None = DEFAULT_MEMORY_MB):
        self.allowed, self.deadline_s, self.memory_mb = sorted(set(allowed)), float(deadline_s), memory_mb
        self.overruns: collections.Counter[str] = collections.Counter()
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one call at a time
        self._reap_lock = threading.Lock()  # a kill by pid and the reaping that frees the pid: never interleaved
        self._closed = False

    def call(self, name: str, fn, text: str, reference: str) -> float:
        """`fn(text, reference)` by its name in the worker; 0.0 when it overruns the deadline (the worker is killed
        and started again on the next call)."""
        del fn  # the worker resolves the same function by name
        with self._lock:
            if self._closed:
                raise WorkerClosed(CLOSED)
            with self._reap_lock:
                alive = self._process is not None and _running(self._process)
            process = self._process if alive else self._start()
            deadline = time.monotonic() + self.deadline_s  # sending too: a worker that stopped reading is an overrun
            sent = _send_within(process.stdin, {"name": name, "text": text, "reference": reference}, deadline)
            answer = _receive(process.stdout, deadline) if sent else None
            if answer is None or answer.get("exited"):  # overran, or died on this input (killed for memory, a crash)
                self._kill()
                if self._closed:  # killed by close(): not this input's doing, and not scored
                    raise WorkerClosed(CLOSED)
                self._failed(name, "overran" if answer is None else answer.get("why", "died"))
                return 0.0
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return float(answer["value"])

    def close(self) -> None:
        """Kill the worker now, a call in flight included (it raises WorkerClosed: that completion is not scored),
        and start none again. It waited for the call in flight before: a sampler's stop up to task.reward_timeout_s,
        and the sink's next group started a new worker after it."""
        with self._reap_lock:
            self._closed = True
            if self._process is not None:
                _signal_group(self._process)
        with self._lock:
            self._kill()

    def _failed(self, name: str, how: str) -> None:
        if not self.overruns[name]:
            what = {"overran": f"did not answer within task.reward_timeout_s={self.deadline_s:g} s",
                    "memory": f"allocated past task.reward_memory_mb={self.memory_mb:g}",
                    "garbled": "garbled its worker's answers (something wrote into the worker's answer pipe)"}.get(
                how, "made its worker exit (killed for memory, or a crash: see its stderr)")
            log.warning("reward %s %s: scored 0 (its worker was restarted; logged once per reward)", name[:64], what)
        self.overruns[name] += 1

    def _start(self) -> subprocess.Popen:
        self._kill()
        settings = json.dumps({"allowed": self.allowed, "path": [p for p in sys.path if p], "parent": os.getpid(),
                               "memory_bytes": int(self.memory_mb * (1 << 20)) if self.memory_mb else None})
        process = subprocess.Popen(
            [sys.executable, "-m", "grpo_stream.common.tasks.reward_workers", settings], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, close_fds=True, start_new_session=True)  # its group: see _kill
        with self._reap_lock:
            self._process = process
            if self._closed:  # close() ran meanwhile
                _signal_group(process)
        ready = _receive(process.stdout, time.monotonic() + max(STARTUP_S, self.deadline_s))
        if ready is None or not ready.get("ready"):
            self._kill()
            if self._closed:
                raise WorkerClosed(CLOSED)
            why = (ready or {}).get("error") or ("it exited (see its stderr)" if ready
                                                 else f"no answer in {STARTUP_S} s")
            raise RuntimeError(f"the reward worker did not start: {why}")
        return self._process

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with self._reap_lock:
            _signal_group(process)
            process.wait()
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class WorkerClosed(RuntimeError):
    """A call to a closed RewardWorker, or one in flight when it was closed (a sampler's stop): nothing scored."""


CLOSED = "the reward worker was closed (its sampler stops): the completion is not scored"


def _signal_group(process: subprocess.Popen) -> None:
    """SIGKILL the worker and whatever a reward started (its process group). Hold the worker's _reap_lock: only
    while the worker is not reaped does its pid name its group and no other."""
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _running(process: subprocess.Popen) -> bool:
    """Whether the worker still runs, without reaping it when it has exited (Popen.poll would): `_kill` signals its
    process group by the worker's pid, which must not be free for reuse by then."""
    if process.returncode is not None:
        return False
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return process.poll() is None
    except AttributeError:  # no waitid on this platform
        return process.poll() is None


def _encode(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return _HEADER.pack(len(data)) + data


def _send(stream, message: dict) -> None:
    """The worker's answers (and the parent's messages before `_send_within`)."""
    try:
        stream.write(_encode(message))
        stream.flush()
    except BrokenPipeError:
        pass  # the worker died: _receive sees its stdout close


def _send_within(stream, message: dict, deadline: float) -> bool:
    """`_send` to the worker, False when the deadline passes first. A blocking write of a message longer than the
    pipe holds (64 KiB: a long completion) waited for ever on a worker that stopped reading (a thread a reward left
    behind holding the GIL): the sampler's scoring thread with it. True also when the worker died (`_receive` sees
    its stdout close)."""
    data = memoryview(_encode(message))
    fd = stream.fileno()
    os.set_blocking(fd, False)  # written here only, by fd: the Popen stream's buffer stays empty
    while data:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([], [fd], [], remaining)[1]:
            return False
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            return True
    return True


def _receive(stream, deadline: float) -> dict | None:
    """The next message, or None when the deadline passes (or the worker died) first. A message longer than
    MAX_ANSWER_BYTES, or one that is not JSON, is the worker's death (its stream can no longer be trusted)."""
    data, wanted, header = bytearray(), _HEADER.size, True  # bytearray: `bytes +=` copied it all at every chunk
    fd = stream.fileno()
    while True:
        while len(data) < wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, wanted - len(data))
            if not chunk:
                return {"exited": True}
            data += chunk
        if not header:
            try:
                return json.loads(data)
            except ValueError:
                return {"exited": True, "why": "garbled"}
        wanted, data, header = _HEADER.unpack(data)[0], bytearray(), False
        if wanted > MAX_ANSWER_BYTES:
            return {"exited": True, "why": "garbled"}


def _worker(settings: dict) -> None:
    """The worker's loop: one reward call per message until stdin closes."""
    set_parent_death_signal(signal.SIGKILL)  # where it cannot (not Linux), the closed stdin still ends the worker
    if os.getppid() != settings["parent"]:
        return  # the parent died before prctl
    _keep_group()
    sys.path[:0] = [p for p in settings["path"] if p not in sys.path]
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what a reward prints goes to stderr, never into the answers
    sys.stdout = sys.stderr
    try:
        functions = {name: resolve(name) for name in settings["allowed"]}
        if any(name.startswith("ifeval_") for name in functions):
            lm_eval_ifeval()  # imported now, not inside the first call's deadline
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        _send(stdout, {"error": _said(exc)})
        return
    _limit_memory(settings.get("memory_bytes"))
    _send(stdout, {"ready": True})
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        message = json.loads(stdin.read(_HEADER.unpack(header)[0]))
        name = message["name"]
        try:
            fn = functions.get(name)
            if fn is None:
                raise ValueError(f"{name[:64]!r} is not one of this run's rewards")
            answer = {"value": float(fn(message["text"], message["reference"]))}
        except MemoryError:  # past the cap: this input's score is 0, and a worker whose heap it filled starts again
            _send(stdout, {"exited": True, "why": "memory"})
            return
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - sent back, raised in the caller with the reward's name
            answer = {"error": _said(exc)}  # SystemExit: a reward's sys.exit() on some input is its error, not a death
        _send(stdout, answer)


def _keep_group() -> None:
    """Fork the keeper: it holds none of the worker's pipes, and when the worker is gone (however it ended: its
    sampler's SIGKILL through PR_SET_PDEATHSIG included) it SIGKILLs the worker's process group, itself with it, so
    nothing a reward started outlives the worker. Call while this process has one thread (fork)."""
    worker = os.getpid()
    if os.fork():
        return
    try:
        signal.signal(signal.SIGTERM, _kill_own_group)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # the answer pipe: the sampler sees it close when the worker dies, not when this does
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        set_parent_death_signal(signal.SIGTERM)  # a signal with a handler: it must act, not just die
        while os.getppid() == worker:  # checked first: the worker may have died before the signal was armed
            time.sleep(KEEPER_POLL_S)
        _kill_own_group()
    finally:
        os._exit(0)


def _kill_own_group(*_) -> None:
    os.killpg(0, signal.SIGKILL)


def _said(exc: BaseException) -> str:
    """An error's type and message, cut to MAX_ERROR_CHARS: a reward that raised with the completion (or a
    gigabyte) in its message made the parent read it all (the caller keeps 300 characters). An exception whose
    str() raises is said by its type alone (it ended the worker before, scored 0 as a death)."""
    try:
        message = str(exc)[:MAX_ERROR_CHARS]
    except Exception as failure:  # noqa: BLE001 - any: the reward's own __str__
        message = f"(its message could not be written: {type(failure).__name__})"
    return f"{type(exc).__name__}: {message}"


def _limit_memory(extra_bytes: int | None) -> None:
    """Cap this process's address space at what it maps now (the interpreter, the rewards' imports) plus
    `extra_bytes` (RLIMIT_AS, soft limit). None, or no /proc (not Linux): no cap."""
    if not extra_bytes:
        return
    try:
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = mapped + extra_bytes if hard == resource.RLIM_INFINITY else min(mapped + extra_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
