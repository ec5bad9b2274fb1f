"""One run per run directory: an exclusive lock on RUN_DIR/run.lock.

A run directory holds state that exactly one set of processes may write: the embedded Redis's append-only file
(RUN_DIR/redis) and the trainer's checkpoints (RUN_DIR/checkpoints). A second `up` on the same directory would
start a second Redis on the same AOF (a corrupted file) and a second trainer on the same checkpoints and buffer
(groups trained twice). So `up` takes an exclusive flock(2) on RUN_DIR/run.lock before it starts anything, and
hands the locked file descriptor to the trainer and the embedded Redis (`pass_fds`; GRPO_STREAM_RUN_LOCK_FD tells
a child which descriptor it holds). The kernel keeps an flock until the last descriptor of that open file is
closed, so the directory stays locked while `up`, the trainer or Redis lives, even when `up` itself was killed and
a child outlived it; it is released by the kernel when they are all gone, whatever killed them (no stale lock file
to clean up). Trainers started without `up` are kept apart by their lease in Redis (trainer_lease.py), which each
takes before it writes the buffer or the checkpoint directory.

The file records who took the lock (pid, role, start time), and a refusal names the holders that still have the
file open (read from /proc), so the message says which process to stop.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pathlib
import time

LOCK_FILE = "run.lock"
LOCK_FD_ENV = "GRPO_STREAM_RUN_LOCK_FD"  # in a child of `up`: the inherited descriptor that holds the lock


class RunDirBusy(RuntimeError):
    """Another run holds the run directory."""


class RunLock:
    """The exclusive lock on one run directory, held while this object's descriptor (or a child's copy) is open."""

    def __init__(self, path: pathlib.Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: pathlib.Path, role: str, wait_s: float = 0.0) -> "RunLock":
        """Lock `run_dir` for `role` (e.g. 'up'), or raise RunDirBusy naming the directory and its holder. `wait_s`:
        how long to keep trying first: a run that was just killed releases the lock only once the last thread of
        its last holder has exited, moments after its main thread shows as dead."""
        path = pathlib.Path(run_dir).resolve() / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_no_link(path)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                    os.close(fd)
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    raise RunDirBusy(busy_message(path, role)) from None
                time.sleep(0.05)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "role": role, "started": _now()}).encode(), 0)
        except OSError as exc:  # a full disk: the lock is not held, and the error names the file (a write's does not)
            os.close(fd)
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        return cls(path, fd)

    def child_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` for a child given this lock's descriptor in `pass_fds` (it then holds the lock too)."""
        return {**env, LOCK_FD_ENV: str(self.fd)}

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # children holding a copy keep the directory locked until they exit
            self.fd = -1


def busy_message(path: pathlib.Path, role: str) -> str:
    """Why `role` cannot have the run directory: who took the lock, and which processes still hold it."""
    try:
        owner = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        owner = {}
    holders = lock_holders(path)
    pid = owner.get("pid")
    who = f"{owner.get('role', 'a run')} (pid {pid}, started {owner.get('started', '?')})" if pid else "another run"
    alive = pid is not None and any(h == pid for h, _ in holders)
    others = [f"{h} ({cmd[:80]})" for h, cmd in holders if h != pid]
    if alive or not others:
        stop = f"Stop it first (kill -TERM {pid})" if pid else "Stop it first"
        held = f"; also held by {', '.join(others)}" if others else ""
        return (f"run directory {path.parent} is in use by {who}{held}: a second {role} there would start a second "
                f"Redis on its append-only file and a second trainer on its checkpoints. {stop}, or choose another "
                "--run-dir")
    return (f"run directory {path.parent} was locked by {who}, which has exited, but its processes still hold it: "
            f"{', '.join(others)}. Stop them (kill -TERM <pid>) before starting {role} there again, or choose "
            "another --run-dir")


def lock_holders(path: pathlib.Path) -> list[tuple[int, str]]:
    """(pid, command line) of every process with `path` open (those /proc lets this user see)."""
    target, out = str(path), []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                out.append((int(proc.name), cmd))
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(out)


def _open_no_link(path: pathlib.Path) -> int:
    """The lock file, opened for writing without following a symbolic link at its name: a link another user planted
    there would make `up` create or truncate the file it names (and write its record into it)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise OSError(errno.ELOOP, f"the run directory's lock file is a symbolic link (to {target}), which is not "
                      "followed: it would make this run write the file it names. If you did not make it, someone "
                      f"else may have: remove it (rm {path}) and check the directory's owner and permissions",
                      str(path)) from None


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
