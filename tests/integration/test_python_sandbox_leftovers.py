"""What a Python tool call leaves behind, attacked for real: SysV IPC objects and keys are refused, a deep or
unreadable tree is removed whatever its shape, and on a tmpfs what a call writes is bounded in bytes and files."""

import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from grpo_stream.common.tools import python_sandbox
from grpo_stream.common.tools.python_sandbox import SandboxLimits, run_python
from tests.integration.test_python_sandbox_parent import as_user_argv, non_root_parent
from tests.sandbox_support import LIMITS, children_of, confined, still_works


def sysv_objects() -> dict[str, list[str]]:
    """The SysV shared memory segments, message queues and semaphores of the uid the sandbox runs as (nobody when
    root), from the machine's /proc listings: other processes of the machine may make their own meanwhile."""
    uid = str(python_sandbox._sandbox_user()[0] if os.geteuid() == 0 else os.getuid())
    listing = {}
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = f.read().splitlines()
        column = header.split().index("uid")
        listing[kind] = [row for row in rows if row.split()[column] == uid]
    return listing


@pytest.fixture
def own_temp(monkeypatch):
    """A temporary folder for this test's sandbox calls alone (tempfile's default, which run_python creates its
    working directories in), so calls other test workers make at the same time never show in `sandbox_dirs`."""
    folder = tempfile.mkdtemp(prefix="grpo-stream-test-temp-")
    os.chmod(folder, 0o755)  # the sandbox's uid (nobody, when root) must reach its working directory
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def sandbox_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("grpo-stream-python-")}


IPC_CODE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
segment = libc.shmget(IPC_PRIVATE, 64 << 20, IPC_CREAT | 0o600)
if segment >= 0:
    libc.shmat.restype = ctypes.c_void_p
    address = libc.shmat(segment, None, 0)
    if address not in (None, ctypes.c_void_p(-1).value):
        ctypes.memset(address, 7, 64 << 20)  # resident until removed: 64 MiB for the machine's life
queue = libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)
semaphores = libc.semget(IPC_PRIVATE, 4, IPC_CREAT | 0o600)
key = libc.syscall(248 if os.uname().machine == "x86_64" else 217, b"user", b"k", b"v", 1, -2)  # add_key
print("ran", segment, queue, semaphores, key)
"""


@confined
def test_sysv_ipc_message_queues_and_keys_are_refused_and_nothing_is_left(own_temp):
    before, dirs_before = sysv_objects(), sandbox_dirs()
    result = run_python(IPC_CODE, LIMITS)
    assert result.error is None, result
    ran, *created = result.stdout.split()
    assert ran == "ran" and created == ["-1", "-1", "-1", "-1"], result.stdout  # each refused
    assert sysv_objects() == before and sandbox_dirs() == dirs_before
    still_works()


DEEP_TREE_CODE = """
import os
print("in", os.getcwd())
made = 0
try:
    for _ in range(1500):
        os.mkdir("d")
        os.chdir("d")
        made += 1
except OSError as exc:
    print("stopped:", type(exc).__name__)
print("depth", made)
"""


@confined
def test_a_deep_tree_never_raises_and_nothing_is_left(own_temp):
    before = sandbox_dirs()
    result = run_python(DEEP_TREE_CODE, LIMITS)
    assert result.error is None and "depth" in result.stdout, result
    assert result.stdout.startswith(f"in {own_temp}/grpo-stream-python-"), result.stdout  # counted where it ran
    assert sandbox_dirs() == before
    still_works()


def test_the_tree_is_removed_however_deep_and_whatever_its_modes(tmp_path):
    """What a plain directory (no tmpfs: not root) is left with: 3,000 levels with 200-character names (a path of
    600,000 characters, beyond PATH_MAX and Python's recursion), unreadable directories, a symlink out."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept")
    top = tmp_path / "work"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    name = "n" * 200
    for depth in range(3000):
        os.mkdir(name, dir_fd=fd)
        os.symlink(outside, f"link{depth % 2}", dir_fd=fd) if depth in (5, 2999) else None
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    os.chmod(top / name, 0)
    python_sandbox._remove_tree(str(top))
    assert not top.exists() and (outside / "keep").read_text() == "kept"


@confined
@pytest.mark.skipif(os.geteuid() != 0, reason="the tmpfs working directory needs root (mount namespace)")
def test_what_a_call_writes_is_bounded_in_bytes_and_files():
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=10, disk_mb=8, max_files=64)
    code = """
import os
written = files = 0
try:
    for i in range(64):
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
        written += 1
except OSError as exc:
    print("bytes stopped:", exc.strerror)
try:
    for i in range(1000):
        os.mkdir(f"d{i}")
        files += 1
except OSError as exc:
    print("files stopped:", exc.strerror)
print(written, files)
"""
    result = run_python(code, limits)
    written, files = map(int, result.stdout.split()[-2:])
    assert "No space left on device" in result.stdout and written <= 8 and files < 64, result.stdout


SAMPLER = """
import sys, threading, time
from grpo_stream.common.tools.python_sandbox import SandboxLimits, run_python
threading.Thread(target=run_python, args=("import time\\ntime.sleep(120)", SandboxLimits(wall_seconds=120))).start()
print("calling", flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@confined
def test_a_call_does_not_outlive_a_sampler_killed_during_it(own_temp):
    """A call asleep uses no CPU, so no limit stops it, and only the parent enforces the wall time: a sampler
    SIGKILLed (OOM, a supervisor) during the call left it running for good, under init. (Its working directory
    stays, in own_temp: the sampler died before removing it.)"""
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": own_temp})
    try:
        assert sampler.stdout.readline() == "calling\n"
        deadline = time.monotonic() + 20
        while not (calls := children_of(sampler.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls, "the sandbox child never started"
        time.sleep(1.0)  # confined and asleep in the code
    finally:
        sampler.kill()
        sampler.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in calls) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in calls), "the call outlived its sampler"


PID_1_SAMPLER = """
import os, time
from grpo_stream.common.tools.python_sandbox import SandboxLimits, run_python
assert os.getpid() == 1
code = "import os, time\\nfor _ in range(4):\\n    if os.fork() == 0:\\n        break\\ntime.sleep(60)"
print(run_python(code, SandboxLimits(cpu_seconds=1, wall_seconds=1, max_processes=8)).error)
time.sleep(0.5)  # the kill's orphans are dead by now
zombies = 0
try:
    while os.waitpid(-1, os.WNOHANG)[0]:
        zombies += 1
    print("zombies", zombies, "and children still running")
except ChildProcessError:
    print("zombies", zombies)
"""


@confined
def test_processes_the_code_forked_leave_no_zombie_in_a_sampler_that_is_pid_1():
    """A sampler that is PID 1 (a container without an init) inherits the orphans of the group kill: with
    max_processes > 0 each call that forked left zombies in it for good, holding the uid's RLIMIT_NPROC places."""
    unshare = shutil.which("unshare")
    if unshare is None or python_sandbox.read_only_reason() is not None:
        pytest.skip("needs util-linux unshare and root with CAP_SYS_ADMIN (a PID namespace)")
    done = subprocess.run([unshare, "--pid", "--fork", sys.executable, "-c", PID_1_SAMPLER], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.splitlines() == ["timed out after 1 s wall time", "zombies 0"], done


def test_a_non_root_owner_removes_a_directory_the_code_made_read_only():
    """The code may chmod its own top directory (chmod is no Landlock right): a non-root sampler then could not
    remove it, and every such call left a directory behind."""
    python, as_user = non_root_parent()
    if not as_user:
        pytest.skip("this test's process is not root: the removal below runs as it")
    workdir = tempfile.mkdtemp(prefix="grpo-stream-test-nonroot-")
    os.chown(workdir, as_user["user"], as_user["group"])
    script = "import itertools, os\n" + inspect.getsource(python_sandbox._remove_tree) + f"""
path = {workdir!r}
os.makedirs(os.path.join(path, "a", "b"))
open(os.path.join(path, "a", "f"), "w").write("x")
os.chmod(path, 0o500)
_remove_tree(path)
print(os.path.exists(path))
"""
    try:
        done = subprocess.run(as_user_argv([python, "-I", "-c", script], as_user), capture_output=True, text=True,
                              timeout=60, cwd="/")
        assert done.returncode == 0 and done.stdout == "False\n", done
    finally:
        if os.path.exists(workdir):
            os.chmod(workdir, 0o700)
            shutil.rmtree(workdir, ignore_errors=True)
