"""The Python tool's sandbox, attacked for real (no mocks): loops, memory and fork bombs, escapes to the file system,
the sampler's token file, the network and floods of output are each stopped with an "error:" observation, leave
nothing behind, and the next call still works. One test runs the child with Landlock alone (no seccomp, the current
uid) to show that layer holds by itself. The sandbox's parent as a non-root uid and the seccomp filter:
test_python_sandbox_parent.py; what a call leaves behind: test_python_sandbox_leftovers.py."""

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from grpo_stream.common.tools import python_sandbox
from grpo_stream.common.tools.python_sandbox import (BOOTSTRAP, UNCONFINED_SETTING, SandboxLimits, SandboxResult,
                                                     python_tool, run_python)
from tests.sandbox_support import LIMITS, SECRET, children_of, confined, still_works, timed


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


CLONE_CODE = """
import ctypes, os, _thread, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for name, flags in (("CLONE_PARENT", 0x8000), ("CLONE_NEWUSER", 0x10000000)):
    pid = libc.syscall(ctypes.c_long(56 if os.uname().machine == "x86_64" else 220), ctypes.c_long(flags | 17),
                       *[ctypes.c_long(0)] * 4)
    if pid == 0:
        os._exit(0)
    print(name, pid, ctypes.get_errno(), flush=True)
pid = os.fork()
if pid == 0:
    os._exit(3)
ran = []
_thread.start_new_thread(ran.append, ("thread",))
time.sleep(0.2)
print("fork", os.waitpid(pid, 0)[1] >> 8, *ran)
"""


@confined
def test_with_processes_allowed_no_fork_becomes_the_samplers_child_or_a_namespace():
    """max_processes > 0: clone(CLONE_PARENT) made the new process this process's child, a zombie nobody reaps,
    which also kept its place in the uid's RLIMIT_NPROC: after max_processes calls none could fork. CLONE_NEW* was
    unshare's namespaces by another door. fork and threads still work (glibc falls back from clone3 to clone)."""
    # RLIMIT_NPROC counts every process of the uid (nobody, when root): room for other tests' calls at the same time
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=6, max_processes=16)
    children = set(children_of(os.getpid()))
    for _ in range(2):
        result = run_python(CLONE_CODE, limits)
        assert result.stdout.splitlines() == ["CLONE_PARENT -1 1", "CLONE_NEWUSER -1 1", "fork 3 thread"], result
    assert set(children_of(os.getpid())) == children


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
        # no tmpfs here (no uid to drop to: the non-root path), so its own directory is read-only too: nothing
        # would bound what it wrote there
        attempts["mine"] = "open('mine', 'w')"
        code = "".join(f"try:\n    {a}\n    print('{k} ALLOWED')\nexcept OSError as e:\n    print('{k}', e.errno)\n"
                       for k, a in attempts.items()) + "print(sorted(os.listdir('.')), 6 * 7)"
        code = "import os\n" + code
        (workdir / "given").write_text("readable")
        done = subprocess.run([sys.executable, "-I", "-S", "-u", "-c", BOOTSTRAP, json.dumps(settings)], input=code,
                              cwd=workdir, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert done.stdout.splitlines() == ["token 13", "open 13", "tmp 13", "proc 13", "tcp 13", "mine 13",
                                        "['given'] 42"], done


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



@confined
def test_anonymous_memory_files_are_refused_and_a_real_time_signal_is_named():
    """memfd_create's pages count against no rlimit until mapped: 64 of 16 MB held a gigabyte of the machine's
    memory per call. A program killed by a signal without a name (real-time) is reported, not raised on."""
    refused = run_python("import os\ntry:\n    os.memfd_create('x')\n    print('ALLOWED')\nexcept OSError as e:\n"
                         "    print(e.errno)", LIMITS)
    assert refused == SandboxResult("1\n", "", 0, None)
    assert run_python("import os\nos.kill(os.getpid(), 40)", LIMITS).error == "killed by signal 40"
    still_works()


@confined
def test_a_sigkill_is_named_the_cpu_limit_only_after_that_much_cpu():
    """RLIMIT_CPU's hard stop is a SIGKILL (the code ignored SIGXCPU); every other SIGKILL (the code's own, the
    kernel's OOM killer) was also answered "CPU limit reached", which sent the model after the wrong cause."""
    assert run_python("import os\nos.kill(os.getpid(), 9)", LIMITS).error == "killed by signal SIGKILL"
    hard_stop = run_python("import _signal\n_signal.signal(24, _signal.SIG_IGN)\nwhile True: pass", LIMITS)
    assert (hard_stop.exit_code, hard_stop.error) == (-9, "CPU limit (1 s of CPU time) reached"), hard_stop
