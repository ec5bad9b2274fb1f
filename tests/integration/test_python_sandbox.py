"""The Python tool's sandbox, attacked for real (no mocks): loops, memory and fork bombs, escapes to the file system,
the sampler's token file, the network and floods of output are each stopped with an "error:" observation, leave
nothing behind, and the next call still works. One test runs the child with Landlock alone (no seccomp, the current
uid) to show that layer holds by itself. Others run the sandbox's parent as a non-root uid (the child then keeps
that uid) and check that the code cannot change the parent's limits or priority, nor signal it; the seccomp filter
itself is run on a small BPF interpreter for both machines it is written for."""

import concurrent.futures
import json
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from grpo_stream.common.tools import python_sandbox, sandbox_child
from grpo_stream.common.tools.python_sandbox import (BOOTSTRAP, UNCONFINED_SETTING, SandboxLimits, SandboxResult,
                                                     confinement_problem, python_tool, run_python)

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=6)  # wall room for 1 s of CPU on a busy machine
SECRET = "grpo-stream-token-" + uuid.uuid4().hex
confined = pytest.mark.skipif(confinement_problem() is not None, reason=f"cannot confine: {confinement_problem()}")


def still_works():
    assert run_python("print(6 * 7)", LIMITS) == SandboxResult("42\n", "", 0, None)


def timed(code: str, limits: SandboxLimits = LIMITS) -> tuple[SandboxResult, float]:
    start = time.monotonic()
    return run_python(code, limits), time.monotonic() - start


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@pytest.fixture
def token_file(tmp_path):
    """A sampler's run directory with its client token (0600), as `grpo-stream tokens` writes it."""
    auth = tmp_path / "run" / "auth"
    auth.mkdir(parents=True)
    token = auth / "client.token"
    token.write_text(SECRET)
    token.chmod(0o600)
    return token


@pytest.fixture
def open_folder():
    """A world-writable folder holding a world-readable file: only Landlock keeps the sandbox out of it."""
    folder = tempfile.mkdtemp(prefix="grpo-stream-test-open-")
    os.chmod(folder, 0o777)
    with open(os.path.join(folder, "readable.txt"), "w") as f:
        f.write(SECRET)
    os.chmod(os.path.join(folder, "readable.txt"), 0o644)
    yield folder
    shutil.rmtree(folder)


@confined
def test_a_computation_returns_its_output_and_the_tool_its_text():
    result, seconds = timed("import math, fractions\nprint(math.comb(10, 3), fractions.Fraction(1, 3) * 3)")
    assert result == SandboxResult("120 1\n", "", 0, None) and seconds < 5
    tool = python_tool(LIMITS)
    assert tool.name == "python" and tool.schema()["function"]["parameters"]["required"] == ["code"]
    assert tool.call({"code": "print(sum(range(101)))"}) == "5050"
    assert tool.call({"code": "x = 1"}) == "(no output: print() the values you want to see)"
    observation = tool.call({"code": "def f(x):\n    return 1 / x\nprint('before')\nf(0)"})
    assert observation.startswith("error: the code raised ZeroDivisionError: division by zero\nstdout:\nbefore\n")
    assert 'File "<code>", line 2, in f' in observation and "<string>" not in observation  # no bootstrap frames


@confined
def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    result, seconds = timed("while True: pass")
    assert result.error == "CPU limit (1 s of CPU time) reached" and seconds < 5
    still_works()


@confined
def test_a_sleeping_program_is_stopped_by_the_wall_limit():
    result, seconds = timed("import time\nprint('started')\ntime.sleep(60)", SandboxLimits(wall_seconds=1))
    assert result.error == "timed out after 1 s wall time" and result.stdout == "started\n" and seconds < 5
    assert python_tool(SandboxLimits(wall_seconds=0.5)).call({"code": "import time; time.sleep(9)"}).startswith(
        "error: timed out after 0.5 s wall time")
    still_works()


@confined
@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(bytearray(10**6))"])
def test_a_memory_bomb_is_contained(code):
    result, seconds = timed(code)
    assert result.error == "memory limit (256 MB) reached: MemoryError" and seconds < 5
    assert python_tool(LIMITS).call({"code": code}).startswith("error: memory limit (256 MB) reached")
    still_works()


@confined
def test_a_fork_bomb_cannot_fork_and_leaves_no_process():
    result, seconds = timed("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()")
    assert "BlockingIOError" in result.error and seconds < 5, result
    assert group_members(int(result.stdout)) == []
    threads = run_python("import _thread\n_thread.start_new_thread(print, ('thread',))", LIMITS)
    assert "can't start new thread" in threads.stderr
    still_works()


@confined
def test_it_cannot_write_outside_its_directory(tmp_path, open_folder):
    targets = [f"/tmp/x_escape_{uuid.uuid4().hex}", str(tmp_path / "escape.txt"), os.path.join(open_folder, "x")]
    code = "import os\nprint(os.getcwd())\nopen('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())\n"
    for target in targets:
        code += f"try:\n    open({target!r}, 'w').write('x')\n    print('WROTE')\nexcept OSError as e:\n" \
                "    print(type(e).__name__)\n"
    result = run_python(code, LIMITS)
    workdir, *lines = result.stdout.splitlines()
    assert lines == ["ok", "PermissionError", "PermissionError", "PermissionError"], result
    assert not any(os.path.exists(target) for target in targets)
    assert not os.path.exists(workdir)  # its own directory is removed after the call, whoever owned it
    still_works()


@confined
def test_it_cannot_read_the_samplers_token(token_file, open_folder):
    paths = [str(token_file), os.path.join(open_folder, "readable.txt"), "/proc/1/environ", "/etc/passwd"]
    code = f"for p in {paths!r}:\n    try:\n        print(open(p).read())\n    except OSError as e:\n" \
           "        print(type(e).__name__)\n"
    code += f"import os\ntry:\n    print(os.listdir({str(token_file.parent)!r}))\nexcept OSError as e:\n" \
            "    print(type(e).__name__)\n"
    result = run_python(code, LIMITS)
    assert result.stdout.splitlines() == ["PermissionError"] * 5, result
    assert SECRET not in result.stdout + result.stderr
    still_works()


@confined
def test_it_cannot_connect_to_a_loopback_port():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"""
import ctypes, struct
try:
    import socket
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    print("CONNECTED")
except Exception as e:
    print("socket module:", type(e).__name__)
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM: below the socket module
address = struct.pack("<H", 2) + struct.pack(">H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)
if fd >= 0 and libc.connect(fd, address, 16) == 0:
    print("CONNECTED")
print("raw socket:", fd, ctypes.get_errno())
"""
        result = run_python(code, LIMITS)
        assert "CONNECTED" not in result.stdout and "raw socket: -1 1" in result.stdout, result  # EPERM
        listener.settimeout(0.3)
        with pytest.raises(TimeoutError):
            listener.accept()
    still_works()


@confined
def test_output_over_the_cap_is_cut():
    result, seconds = timed("while True:\n    print('x' * 1000)")
    assert result.error == "output cut at 8192 bytes (the program was stopped)" and seconds < 5
    assert len(result.stdout) == 8192
    assert python_tool(SandboxLimits(output_bytes=100)).call({"code": "print('y' * 500)"}) == \
        "error: output cut at 100 bytes (the program was stopped)\nstdout:\n" + "y" * 100
    still_works()


@confined
def test_privileges_are_gone():
    result = run_python("import os\ntry:\n    os.setsid()\nexcept OSError as e:\n    print('setsid', e.errno)\n"
                        "print(os.getuid(), os.getgroups())\ntry:\n    os.setuid(0)\n    print('ROOT')\n"
                        "except OSError as e:\n    print('setuid', e.errno)", LIMITS)
    setsid, ids, setuid = result.stdout.splitlines()
    assert setsid == "setsid 1" and setuid == "setuid 1"
    if os.geteuid() == 0:
        assert ids == "65534 []"  # root's sandbox runs as nobody
    else:
        assert ids.split()[0] == str(os.getuid())


@confined
def test_landlock_alone_holds(tmp_path, token_file, open_folder):
    """The child with Landlock but no seccomp and no uid drop (the current uid, root here: file permissions stop
    nothing): reads, writes and TCP connects outside its directory are still refused."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    settings = python_sandbox.child_settings(LIMITS, str(workdir), None, confine=True)
    settings["seccomp"] = False
    with socket.create_server(("127.0.0.1", 0)) as listener:
        attempts = {"token": f"open({str(token_file)!r}).read()", "open": f"open({open_folder!r} + '/x', 'w')",
                    "tmp": f"open('/tmp/x_escape_{uuid.uuid4().hex}', 'w')", "proc": "open('/proc/1/environ').read()",
                    "tcp": f"__import__('socket').create_connection(('127.0.0.1', {listener.getsockname()[1]}), 1)"}
        code = "".join(f"try:\n    {a}\n    print('{k} ALLOWED')\nexcept OSError as e:\n    print('{k}', e.errno)\n"
                       for k, a in attempts.items()) + "open('mine', 'w').write('ok')\nprint(open('mine').read())"
        done = subprocess.run([sys.executable, "-I", "-S", "-u", "-c", BOOTSTRAP, json.dumps(settings)], input=code,
                              cwd=workdir, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert done.stdout.splitlines() == ["token 13", "open 13", "tmp 13", "proc 13", "tcp 13", "ok"], done


@confined
def test_concurrent_calls_from_a_thread_pool():
    codes = [f"print({i} * 3)" for i in range(8)] + ["while True: pass"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda code: run_python(code, LIMITS), codes))
    assert [r.stdout for r in results[:8]] == [f"{i * 3}\n" for i in range(8)]
    assert results[8].error == "CPU limit (1 s of CPU time) reached"


def test_without_landlock_it_refuses_unless_allowed_unconfined(monkeypatch):
    monkeypatch.setattr(python_sandbox, "confinement_problem", lambda: "this kernel has no Landlock (test)")
    refused = run_python("print(1)", LIMITS)
    assert refused.exit_code is None and UNCONFINED_SETTING in refused.error
    assert python_tool(LIMITS).call({"code": "print(1)"}).startswith(
        "error: the Python tool is disabled: this kernel has no Landlock (test). Set "
        "environment.python_tool.allow_unconfined=true")
    unconfined = SandboxLimits(cpu_seconds=1, wall_seconds=6, allow_unconfined=True)
    assert run_python("print(2 ** 10)", unconfined).stdout == "1024\n"
    assert run_python("while True: pass", unconfined).error == "CPU limit (1 s of CPU time) reached"
    assert "BlockingIOError" in run_python("import os\nos.fork()", unconfined).error  # rlimits still hold


# The sandbox's parent as a non-root uid: the child keeps that uid, so only the seccomp filter (and, for signals,
# Landlock ABI >= 6) stops it from reaching the parent through its pid.
DRIVER = """
import json, os, resource, subprocess, sys
job = json.load(sys.stdin)
def state():
    return {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "cpu": resource.getrlimit(resource.RLIMIT_CPU),
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "affinity": sorted(os.sched_getaffinity(0))}
before = state()
done = subprocess.run([sys.executable, "-I", "-S", "-u", "-c", job["bootstrap"], job["settings"]], input=job["code"],
                      cwd=job["workdir"], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"},
                      start_new_session=True)
print(json.dumps({"uid": os.getuid(), "before": before, "after": state(), "stdout": done.stdout,
                  "stderr": done.stderr}))
"""
ON_THE_PARENT = {"prlimit NOFILE": "resource.prlimit(parent, resource.RLIMIT_NOFILE, (100, 100))",
                 "prlimit CPU": "resource.prlimit(parent, resource.RLIMIT_CPU, (1, 1))",
                 "prlimit read": "resource.prlimit(parent, resource.RLIMIT_NOFILE)",
                 "kill 0": "os.kill(parent, 0)", "kill 9": "os.kill(parent, 9)",
                 "killpg 0": "os.killpg(os.getpgid(parent), 0)", "kill -1 0": "os.kill(-1, 0)",
                 "setpriority": "os.setpriority(os.PRIO_PROCESS, parent, 19)",
                 "setpriority group": "os.setpriority(os.PRIO_PGRP, os.getpgid(parent), 19)",
                 "sched_setaffinity": "os.sched_setaffinity(parent, {min(os.sched_getaffinity(0))})",
                 "pidfd_open": "os.pidfd_open(parent)"}
ON_ITSELF = {"own prlimit": "resource.prlimit(0, resource.RLIMIT_NOFILE, (32, 32))",
             "own kill 0": "os.kill(os.getpid(), 0)", "own setpriority": "os.setpriority(os.PRIO_PROCESS, 0, 5)"}


def attempts_code(attempts: dict[str, str]) -> str:
    """Code that tries each attempt and prints "<name> ALLOWED" or "<name> <errno>", then its own NOFILE limit."""
    code = "import os, resource\nparent = os.getppid()\n"
    code += "".join(f"try:\n    {a}\n    print('{k} ALLOWED')\nexcept OSError as e:\n    print('{k}', e.errno)\n"
                    for k, a in attempts.items())
    return code + "print('own NOFILE', *resource.getrlimit(resource.RLIMIT_NOFILE))\n"


def non_root_parent() -> tuple[str, dict]:
    """A Python and the subprocess arguments that run it as a non-root uid: this process's own when it is not
    root, else uid/gid 65534 with a Python that uid can run (pyenv under /root is unreadable to it); skips when
    there is none."""
    if os.geteuid() != 0:
        return sys.executable, {}
    as_nobody = {"user": 65534, "group": 65534, "extra_groups": []}
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            probe = subprocess.run([python, "-I", "-c", "import json, resource, subprocess"], cwd="/",
                                   capture_output=True, timeout=30, **as_nobody)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return python, as_nobody
    pytest.skip("no Python that uid 65534 can run (this one is unreadable to it, and no /usr/bin/python3)")


def run_under_non_root_parent(code: str, confine: bool, seccomp: bool) -> dict:
    """Runs the sandbox child with `code` below a non-root parent (DRIVER); returns the parent's report: its uid,
    its limits, niceness and affinity before and after, and the child's output."""
    python, as_user = non_root_parent()
    workdir = tempfile.mkdtemp(prefix="grpo-stream-test-nonroot-")
    try:
        if as_user:
            os.chown(workdir, as_user["user"], as_user["group"])
        settings = python_sandbox.child_settings(LIMITS, workdir, None, confine=confine)
        settings["seccomp"] = seccomp
        job = json.dumps({"bootstrap": BOOTSTRAP, "settings": json.dumps(settings), "code": code, "workdir": workdir})
        done = subprocess.run([python, "-I", "-c", DRIVER], input=job, cwd=workdir, capture_output=True, text=True,
                              timeout=60, start_new_session=True, **as_user)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert done.returncode == 0, f"the parent died ({done.returncode}): {done.stderr}"
    report = json.loads(done.stdout)
    assert report["uid"] != 0 and report["uid"] == as_user.get("user", os.getuid()), report
    return report


@confined
@pytest.mark.parametrize("confine", [True, False], ids=["landlock and seccomp", "seccomp alone"])
def test_a_non_root_sampler_cannot_be_reached_through_its_pid(confine):
    """The child keeps the parent's uid, which the kernel lets change the parent's limits, priority and affinity
    and signal it: the filter refuses every call on the parent's pid (also without Landlock, whose signal scoping
    older kernels lack), while the code may still do the same to itself."""
    report = run_under_non_root_parent(attempts_code({**ON_THE_PARENT, **ON_ITSELF}), confine, seccomp=True)
    expected = [f"{name} 1" for name in ON_THE_PARENT] + [f"{name} ALLOWED" for name in ON_ITSELF]
    assert report["stdout"].splitlines() == expected + ["own NOFILE 32 32"], report
    assert report["after"] == report["before"], report


@confined
def test_without_the_filter_a_non_root_child_could_change_its_parents_limits():
    """The hole the filter closes is real: with Landlock alone, the same uid's prlimit reaches the parent."""
    report = run_under_non_root_parent(attempts_code({"prlimit NOFILE": ON_THE_PARENT["prlimit NOFILE"]}),
                                       confine=True, seccomp=False)
    assert report["stdout"].splitlines()[0] == "prlimit NOFILE ALLOWED", report
    assert report["after"]["nofile"] == [100, 100], report


@confined
def test_the_code_cannot_change_the_samplers_limits_or_signal_it():
    """This process (root here: the child is nobody) as the sampler: the same calls on the parent's pid fail."""
    limits = {which: resource.getrlimit(which) for which in (resource.RLIMIT_NOFILE, resource.RLIMIT_CPU)}
    attempts = {name: ON_THE_PARENT[name] for name in ("prlimit NOFILE", "prlimit CPU", "kill 0", "setpriority")}
    result = run_python(attempts_code(attempts), LIMITS)
    assert result.stdout.splitlines()[:-1] == [f"{name} 1" for name in attempts], result
    assert {which: resource.getrlimit(which) for which in limits} == limits
    still_works()


def evaluate_filter(program: list[tuple[int, int, int, int]], arch: int, number: int, *args: int) -> int:
    """Runs a seccomp program (the instructions sandbox_child uses) on one syscall; returns the action."""
    data = struct.pack("<iIQ6Q", number, arch, 0, *[a & (1 << 64) - 1 for a in (*args, *[0] * (6 - len(args)))])
    pc, accumulator = 0, None
    while True:
        code, jt, jf, k = program[pc]
        if code == sandbox_child.BPF_LD_W_ABS:
            accumulator, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (sandbox_child.BPF_JEQ_K, sandbox_child.BPF_JGE_K):
            taken = accumulator == k if code == sandbox_child.BPF_JEQ_K else accumulator >= k
            pc += 1 + (jt if taken else jf)
        else:
            assert code == sandbox_child.BPF_RET_K
            return k


@pytest.mark.parametrize("machine", sorted(sandbox_child.SECCOMP_ARCHES))
def test_the_seccomp_filter_allows_calls_on_the_sandbox_only(machine):
    own, parent = 4321, 1234
    program = sandbox_child.seccomp_program(machine, own)
    arch, column = sandbox_child.SECCOMP_ARCHES[machine]
    allow, deny = sandbox_child.SECCOMP_RET_ALLOW, sandbox_child.SECCOMP_RET_ERRNO | sandbox_child.EPERM

    def action(name: str, *args: int) -> int:
        return evaluate_filter(program, arch, sandbox_child.SYSCALL_NUMBERS[name][column], *args)

    assert evaluate_filter(program, arch ^ 1, 0) == sandbox_child.SECCOMP_RET_KILL_PROCESS  # another ABI
    assert evaluate_filter(program, arch, sandbox_child.X32_SYSCALL_BIT | 39) == deny
    assert evaluate_filter(program, arch, 172 if machine == "aarch64" else 39) == allow  # getpid
    for name in sandbox_child.SECCOMP_DENIED:
        assert action(name, 0) == action(name, own) == deny, name
    for name, (argument, own_allowed, which) in sandbox_child.SECCOMP_OWN_PID.items():
        def call(pid: int, which_value: int = which or 0) -> int:
            args = [which_value, 0, 0] if which is not None else [0, 0, 0]
            args[argument] = pid
            return action(name, *args)
        assert call(0) == allow and call(own) == (allow if own_allowed else deny), name
        for pid in (parent, -1, -own, own | 1 << 32, 1 << 32):  # another process, all, a group, stray high bits
            assert call(pid) == deny, (name, pid)
        if which is not None:
            assert call(0, which + 1) == call(0, which | 1 << 32) == deny, name  # a group or a user, not a process
    assert action("prlimit64", 0, 7, 1) == allow and action("prlimit64", parent, 7) == deny


@pytest.mark.parametrize("machine, header", [("x86_64", "x86_64-linux-gnu/asm/unistd_64.h"),
                                             ("aarch64", "asm-generic/unistd.h")])
def test_the_syscall_numbers_match_the_kernel_headers(machine, header):
    path = os.path.join("/usr/include", header)
    if not os.path.exists(path):
        pytest.skip(f"{path} is not installed (linux-libc-dev)")
    with open(path) as f:
        numbers = {name: int(n) for name, n in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", f.read())}
    column = sandbox_child.SECCOMP_ARCHES[machine][1]
    assert {name: values[column] for name, values in sandbox_child.SYSCALL_NUMBERS.items()} == {
        name: numbers[name] for name in sandbox_child.SYSCALL_NUMBERS}


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
def test_sysv_ipc_message_queues_and_keys_are_refused_and_nothing_is_left():
    before, dirs_before = sysv_objects(), sandbox_dirs()
    result = run_python(IPC_CODE, LIMITS)
    assert result.error is None, result
    ran, *created = result.stdout.split()
    assert ran == "ran" and created == ["-1", "-1", "-1", "-1"], result.stdout  # each refused
    assert sysv_objects() == before and sandbox_dirs() == dirs_before
    still_works()


DEEP_TREE_CODE = """
import os
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
def test_a_deep_tree_never_raises_and_nothing_is_left():
    before = sandbox_dirs()
    result = run_python(DEEP_TREE_CODE, LIMITS)
    assert result.error is None and "depth" in result.stdout, result
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
