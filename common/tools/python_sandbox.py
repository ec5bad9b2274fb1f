"""The Python tool: the model's code runs in a separate, confined, resource-limited process (docs/tools.md).

Each call gets a fresh temporary working directory (the only place it may write) and a fresh interpreter,
`python -I -S -u -c BOOTSTRAP`, in its own session, with a minimal environment and no inherited descriptors. The
child confines itself before the code runs (sandbox_child.py: rlimits, no_new_privs, Landlock, nobody when started
as root, seccomp); this side writes the code to its stdin, reads its output up to a cap, enforces the wall time,
kills the whole process group at the end and removes the directory. Whatever the code does comes back as a
SandboxResult, never as an exception: `python_tool` turns it into the model's observation.

Without Landlock (Linux < 5.13, or landlock not among the kernel's LSMs) or a seccomp filter for this machine, the
tool refuses to run (fail closed) unless SandboxLimits.allow_unconfined (environment.python_tool.allow_unconfined):
then it runs with rlimits, no_new_privs, the uid drop (as root) and the seccomp filter where there is one, and the
code can read whatever that uid can read. `python_tool` logs a disabled, unconfined, failing or read-only tool.

Thread-safe: the sampler calls it from a worker pool. Nothing runs between fork and exec in the parent
(no preexec_fn), every call has its own directory, pipes and selector, and no module state is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import pathlib
import pwd
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from grpo_stream.common.tools import sandbox_child
from grpo_stream.common.tools.functions import Tool, tool_from_function

log = logging.getLogger(__name__)
BOOTSTRAP = pathlib.Path(sandbox_child.__file__).read_text()
UNCONFINED_SETTING = "environment.python_tool.allow_unconfined"
_DISABLED = ("the Python tool is disabled: {}. Set " + UNCONFINED_SETTING + "=true to run it with resource limits only "
             "(the code could then read this user's files)")
_CHUNK = 65536
_TAIL_LINES = 20
_REAP_SECONDS = 10  # how long the child may take to die after SIGKILL (stuck in the kernel: left to Popen)
_GROUP_SECONDS = 1  # how long the rest of its process group (what the code forked) is waited for after that


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one call. The field names match config environment.python_tool (PythonToolSection)."""

    cpu_seconds: float = 2.0  # RLIMIT_CPU, rounded up to whole seconds; the hard stop is one second later
    wall_seconds: float = 5.0  # from start to the process group's SIGKILL
    memory_mb: int = 256  # RLIMIT_AS: the address space, so a large allocation fails with MemoryError
    output_bytes: int = 8192  # per stream (stdout, stderr); more stops the program
    file_mb: int = 16  # RLIMIT_FSIZE: the largest file the code may write in its directory
    max_processes: int = 0  # RLIMIT_NPROC: 0 forbids fork and threads; see docs/tools.md before raising it
    disk_mb: int = 64  # as root: the size of the call's tmpfs working directory (all its files together)
    max_files: int = 1024  # as root: files and directories the call may create (the tmpfs's inodes)
    allow_unconfined: bool = False  # run without Landlock/seccomp where the kernel lacks them (see module doc)

    def __post_init__(self):
        for name, kind, low, high in (("cpu_seconds", float, 0.001, 600), ("wall_seconds", float, 0.001, 600),
                                      ("memory_mb", int, 32, 65536), ("output_bytes", int, 64, 1 << 20),
                                      ("file_mb", int, 1, 65536), ("max_processes", int, 0, 64),
                                      ("disk_mb", int, 1, 65536), ("max_files", int, 16, 1 << 20)):
            value = getattr(self, name)
            kinds = (int, float) if kind is float else (int,)
            if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
                what = "a number" if kind is float else "an integer"
                raise ValueError(f"environment.python_tool.{name}={value!r}: must be {what} from {low} to {high}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one call did: its output (each cut at output_bytes), its exit code (negative: killed by that signal;
    None: it never started), and `error`, None when it ran to a zero exit, else what stopped it, in words."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None


@dataclasses.dataclass
class _Exchange:
    stdout: bytearray
    stderr: bytearray
    timed_out: bool = False
    cut: bool = False


def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """The "python" tool: runs a program in the sandbox and returns what it prints, or an "error: ..." text that
    names the limit it hit (with its output and the last lines of its traceback)."""
    limits = limits or SandboxLimits()
    _log_what_calls_get(limits)

    def python(code: str) -> str:
        """Runs a Python program.

        Args:
            code: a complete Python 3 program; print() the values you want to see.
        """
        return observation(run_python(code, limits))

    description = (f"Run a Python 3 program in a fresh sandboxed interpreter and return what it prints. It has the "
                   f"standard library (math, fractions, itertools, ...), {limits.cpu_seconds:g} s of CPU, "
                   f"{limits.memory_mb} MB of memory, no network and no files outside its own working directory; "
                   "nothing is kept between calls.")
    return tool_from_function(python, description=description)


def _log_what_calls_get(limits: SandboxLimits) -> None:
    """Logs what only the model would see: a disabled or unconfined tool, a setup that fails on every call, a
    working directory the code cannot write (one call is run to see: an LSM may refuse the mount)."""
    problem = confinement_problem()
    if problem and not limits.allow_unconfined:
        return log.error("%s; every call answers the model this error", _DISABLED.format(problem))
    if problem:
        log.warning("the Python tool runs unconfined (%s=true): %s; its code can read this user's files",
                    UNCONFINED_SETTING, problem)
    probe = run_python("open('written', 'w').close()", limits)
    if probe.exit_code in (None, sandbox_child.SETUP_FAILED):
        log.error("the Python tool cannot run: %s; every call answers the model this error", probe.error)
    elif (probe.error or "").startswith("the code raised"):  # not a timeout on a busy machine
        log.warning("the Python tool's calls get no bounded tmpfs (%s): their working directory is read-only to the "
                    "code, which may compute and print but not write files", read_only_reason() or probe.error)


def observation(result: SandboxResult) -> str:
    """The model's view of a call: its stdout (and stderr, if any), or "error: <what stopped it>" followed by
    whatever it printed and the last lines of its stderr (the traceback)."""
    parts = [] if result.error is None else [f"error: {result.error}"]
    stdout = result.stdout if result.error is None else (f"stdout:\n{result.stdout}" if result.stdout else "")
    if stdout:
        parts.append(stdout.rstrip("\n"))
    if result.stderr.strip():
        tail = result.stderr.rstrip("\n").splitlines()[-_TAIL_LINES:]
        parts.append("stderr (last lines):\n" + "\n".join(tail))
    return "\n".join(parts) if parts else "(no output: print() the values you want to see)"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Runs `code` in a new confined process under `limits` and returns what happened. Never raises for anything
    the code does; a refusal (no Landlock and allow_unconfined off) or a failed start is a result with an error."""
    limits = limits or SandboxLimits()
    problem = confinement_problem()
    if problem and not limits.allow_unconfined:
        return SandboxResult("", "", None, _DISABLED.format(problem))
    try:
        workdir = tempfile.mkdtemp(prefix="grpo-stream-python-")
    except OSError as exc:
        return SandboxResult("", "", None, f"could not create the sandbox's directory: {exc}")
    try:
        return _run_in(workdir, code, limits, confine=problem is None)
    except OSError as exc:  # the pipes or the wait failed: a result, never an exception in the model's turn
        return SandboxResult("", "", None, f"the sandbox failed: {exc}")
    finally:
        try:
            _remove_tree(workdir)
        except OSError as exc:  # never raised to the model's turn; the directory is named for the operator
            log.warning("the Python tool could not remove %s: %s", workdir, exc)


def _run_in(workdir: str, code: str, limits: SandboxLimits, confine: bool) -> SandboxResult:
    user = _sandbox_user()
    command = [sys.executable, "-I", "-S", "-u", "-c", BOOTSTRAP,
               json.dumps(child_settings(limits, workdir, user, confine))]
    environment = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    try:
        if user is not None:
            os.chown(workdir, *user)
        process = subprocess.Popen(command, cwd=workdir, env=environment, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                   close_fds=True)
    except OSError as exc:
        return SandboxResult("", "", None, f"could not start the sandbox ({sys.executable}): {exc}")
    try:
        exchange = _exchange(process, code.encode("utf-8", "replace"), limits)
    finally:
        cpu_used = _stop(process)
    stdout, stderr = (output.decode("utf-8", "replace") for output in (exchange.stdout, exchange.stderr))
    return SandboxResult(stdout, stderr, process.returncode,
                         _failure(exchange, process.returncode, cpu_used, stderr, limits))


@functools.cache
def read_only_reason() -> str | None:
    """Why the calls' working directory cannot be a tmpfs of disk_mb (then it is read-only to the code: nothing else
    would bound what it writes), or None: a tmpfs needs root with CAP_SYS_ADMIN (a mount namespace)."""
    if os.geteuid() != 0:
        return "the sampler does not run as root"
    try:
        with open("/proc/self/status") as status:
            effective = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return None  # cannot tell: the child finds out, and stays read-only if it cannot mount
    return None if effective & (1 << 21) else "the sampler's root has no CAP_SYS_ADMIN (a container's default)"


@functools.cache
def confinement_problem() -> str | None:
    """Why this machine cannot confine the child (no Landlock, no seccomp filter for this machine), or None."""
    if sandbox_child.landlock_abi() < 1:
        return ("this kernel has no Landlock (Linux >= 5.13 with landlock in the LSM list: "
                "cat /sys/kernel/security/lsm)")
    if os.uname().machine not in sandbox_child.SECCOMP_ARCHES:
        return f"no seccomp filter is written for {os.uname().machine} (common/tools/sandbox_child.py)"
    return None


def _sandbox_user() -> tuple[int, int] | None:
    """(uid, gid) of nobody when this process is root (root ignores RLIMIT_NPROC and may read any file), else None:
    the child keeps this process's uid."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    return 65534, 65534


def child_settings(limits: SandboxLimits, workdir: str, user: tuple[int, int] | None, confine: bool) -> dict:
    """The child's argv[1] (sandbox_child.py): limits in its units, its directory, the uid/gid to drop to, whether to
    apply Landlock, and seccomp: wherever there is a filter, also unconfined (no sockets, group, sampler's pid)."""
    return {"cpu_seconds": max(1, math.ceil(limits.cpu_seconds)), "memory_bytes": limits.memory_mb << 20,
            "file_bytes": limits.file_mb << 20, "max_processes": limits.max_processes, "workdir": workdir,
            "disk_bytes": limits.disk_mb << 20, "max_files": limits.max_files,
            "user": list(user) if user else None, "confine": confine,
            "seccomp": os.uname().machine in sandbox_child.SECCOMP_ARCHES, "parent": os.getpid()}


def _exchange(process: subprocess.Popen, code: bytes, limits: SandboxLimits) -> _Exchange:
    """Writes the code to the child's stdin and reads its stdout and stderr (each up to output_bytes) until both
    close and it exits, or the wall time runs out, or an output passes its cap. Never blocks past the deadline."""
    deadline = time.monotonic() + limits.wall_seconds
    exchange = _Exchange(bytearray(), bytearray())
    buffers = {process.stdout.fileno(): exchange.stdout, process.stderr.fileno(): exchange.stderr}
    stdin, pending = process.stdin.fileno(), memoryview(code)
    os.set_blocking(stdin, False)
    with selectors.DefaultSelector() as selector:
        selector.register(stdin, selectors.EVENT_WRITE)
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                exchange.timed_out = True
                return exchange
            for key, _ in selector.select(remaining):
                if key.fd == stdin:
                    pending = _write_some(stdin, pending)
                    if not pending:
                        selector.unregister(stdin)
                        process.stdin.close()
                    continue
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                buffer += chunk
                if len(buffer) > limits.output_bytes:
                    del buffer[limits.output_bytes:]
                    exchange.cut = True
                    return exchange
    exchange.timed_out = not _exited(process.pid, deadline)  # it may close its output and keep running
    return exchange


def _exited(pid: int, deadline: float) -> bool:
    """Waits until the child exits or the deadline passes, without reaping it: while it is an unreaped zombie its
    pid (and so its process group id) cannot be reused, so _stop's killpg cannot reach another process."""
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _write_some(fd: int, pending: memoryview) -> memoryview:
    try:
        return pending[os.write(fd, pending[:_CHUNK]):]
    except BlockingIOError:
        return pending
    except BrokenPipeError:  # the child stopped reading (it died): the rest cannot be delivered
        return pending[len(pending):]


def _stop(process: subprocess.Popen) -> float | None:
    """SIGKILL to the child's process group (it cannot leave it: setsid/setpgid are denied), then reaps it and
    returns the CPU seconds it used (None when it could not be reaped). The child is not reaped before this
    (_exited), so its pid still names its own group."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
            os.killpg(process.pid, signal.SIGKILL)
    cpu_used = None
    if _exited(process.pid, time.monotonic() + _REAP_SECONDS):  # else stuck in the kernel; Popen reaps it later
        try:
            _, status, usage = os.wait4(process.pid, 0)  # its rusage tells a CPU limit's SIGKILL from another one
            process.returncode = os.waitstatus_to_exitcode(status)
            cpu_used = usage.ru_utime + usage.ru_stime
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as Popen.wait has it
            process.returncode = 0
        _reap_group(process.pid, time.monotonic() + _GROUP_SECONDS)
    for stream in (process.stdin, process.stdout, process.stderr):
        with contextlib.suppress(OSError):
            stream.close()
    return cpu_used


def _reap_group(pgid: int, deadline: float) -> None:
    """Waits, until the deadline, for the killed group's other processes (with max_processes > 0, what the code
    forked) to be gone, reaping those that became this process's children: where the sampler is PID 1 (a container
    without an init) or a subreaper, the kill's orphans are handed to it and would otherwise stay zombies for ever,
    each holding a place of the uid's RLIMIT_NPROC. A zombie of the group keeps its id, so no other group has it."""
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return  # no process of the group is left, not even a zombie
        with contextlib.suppress(ChildProcessError):  # none of them is this process's child (yet)
            while os.waitpid(-pgid, os.WNOHANG)[0]:
                pass
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def _failure(exchange: _Exchange, exit_code: int | None, cpu_used: float | None, stderr: str,
             limits: SandboxLimits) -> str | None:
    """What stopped the program, in words the model can act on; None for a clean exit."""
    if exchange.cut:
        return f"output cut at {limits.output_bytes} bytes (the program was stopped)"
    if exchange.timed_out:
        return f"timed out after {limits.wall_seconds:g} s wall time"
    if exit_code == 0:
        return None
    last_line = stderr.rstrip("\n").rsplit("\n", 1)[-1]
    cpu = max(1, math.ceil(limits.cpu_seconds))
    if exit_code == sandbox_child.SETUP_FAILED and last_line.startswith("sandbox: "):
        return f"the sandbox could not be set up ({last_line.removeprefix('sandbox: ')}); the code did not run"
    # SIGKILL unsent by us is RLIMIT_CPU's hard stop only after the soft limit's CPU; else the code's own kill or
    # the kernel's OOM killer
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_used is not None and cpu_used >= cpu):
        return f"CPU limit ({cpu} s of CPU time) reached"
    if last_line.startswith("MemoryError"):
        return f"memory limit ({limits.memory_mb} MB) reached: MemoryError"
    if exit_code is not None and exit_code < 0:
        try:
            return f"killed by signal {signal.Signals(-exit_code).name}"
        except ValueError:  # a real-time signal has no name
            return f"killed by signal {-exit_code}"
    if "Traceback (most recent call last)" in stderr or "Error" in last_line:
        return f"the code raised {last_line}"
    return f"exited with code {exit_code}"


def _remove_tree(path: str) -> None:
    """Removes the working directory, however deep, whoever owns what is in it (nobody, when started as root), without
    recursion and without following a symlink: each pass lifts the contents of every directory at the top into the
    top (renames relative to open directories, so no path grows long), removes what is empty or not a directory, and
    ends when the top is empty. A non-root owner first gives itself back the permissions the code may have taken."""
    if os.geteuid() != 0:
        os.chmod(path, 0o700)  # the code may have taken the top's permissions too (chmod . 0o500)
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    lifted = itertools.count()
    try:
        while True:
            with os.scandir(top) as entries:
                names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            if not names:
                break
            for name, is_dir in names:
                if not is_dir:
                    os.unlink(name, dir_fd=top)
                    continue
                if os.geteuid() != 0:
                    os.chmod(name, 0o700, dir_fd=top)  # a directory: chmod follows no symlink here
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    children = os.listdir(inner)
                    for child in children:
                        os.rename(child, f".lifted-{next(lifted)}", src_dir_fd=inner, dst_dir_fd=top)
                finally:
                    os.close(inner)
                if not children:
                    os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)
