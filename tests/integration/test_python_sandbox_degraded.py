"""The Python tool where a layer of the sandbox is missing, attacked for real: without Landlock
(allow_unconfined) the seccomp filter still keeps the code off the network and in its process group, and a tool that
is disabled, or whose sandbox cannot be set up, says so in the sampler's log (the model alone saw it before)."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from grpo_stream.common.tools import python_sandbox, sandbox_child
from grpo_stream.common.tools.python_sandbox import UNCONFINED_SETTING, SandboxLimits, python_tool, run_python
from tests.sandbox_support import LIMITS, confined, still_works

# processes allowed: a forked one tries to leave the group (RLIMIT_NPROC counts the uid's: room for other calls)
UNCONFINED = SandboxLimits(cpu_seconds=1, wall_seconds=6, max_processes=16, allow_unconfined=True)
NO_LANDLOCK = "this kernel has no Landlock (test)"


@pytest.fixture
def no_landlock(monkeypatch):
    """This machine as one without Landlock: run_python then starts the child without it (allow_unconfined)."""
    monkeypatch.setattr(python_sandbox, "confinement_problem", lambda: NO_LANDLOCK)


@confined  # the machine has a seccomp filter (and Landlock, switched off by the fixture)
@pytest.mark.skipif(os.uname().machine not in sandbox_child.SECCOMP_ARCHES, reason="no seccomp filter here")
def test_without_landlock_the_code_still_cannot_connect_to_loopback_or_leave_its_group(no_landlock):
    """allow_unconfined ran the code without the seccomp filter too, though only Landlock was missing: it connected
    to the sampler's loopback services (Redis, the trainer's gRPC: open to anyone under auth.mode none), left the
    process group the wall-time kill reaches (setsid), and a non-root sampler's code could kill its sampler
    (os.kill(os.getppid(), 9): the same uid)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        code = ("import os\npid = os.fork()\nif pid == 0:\n    try:\n        os.setsid()\n        os._exit(0)\n"
                "    except OSError as e:\n        os._exit(e.errno)\nprint('setsid', os.waitpid(pid, 0)[1] >> 8)\n"
                "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
                f"address = struct.pack('<H', 2) + struct.pack('>H', {listener.getsockname()[1]}) + "
                "bytes([127, 0, 0, 1]) + bytes(8)\n"
                "connected = fd >= 0 and libc.connect(fd, address, 16) == 0\n"
                "print('CONNECTED' if connected else 'socket', ctypes.get_errno())\n")
        result = run_python(code, UNCONFINED)
        assert result.stdout.splitlines() == ["setsid 1", "socket 1"], result  # EPERM both
        listener.settimeout(0.3)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert run_python("print(2 ** 10)", UNCONFINED).stdout == "1024\n"


def test_a_disabled_or_unconfined_tool_says_so_in_the_log(no_landlock, caplog):
    """A kernel without Landlock disabled the tool (every call an error for the model) and nothing in the sampler's
    log said so: a run trained without its tool unnoticed."""
    with caplog.at_level(logging.WARNING, logger=python_sandbox.__name__):
        tool = python_tool(SandboxLimits())
    assert tool.call({"code": "print(1)"}).startswith("error: the Python tool is disabled")
    disabled = [r for r in caplog.records if "is disabled" in r.getMessage()]
    assert len(disabled) == 1 and NO_LANDLOCK in disabled[0].getMessage(), caplog.text
    assert UNCONFINED_SETTING in disabled[0].getMessage() and disabled[0].levelno == logging.ERROR
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=python_sandbox.__name__):
        python_tool(UNCONFINED)
    assert any("runs unconfined" in r.getMessage() and NO_LANDLOCK in r.getMessage() for r in caplog.records), \
        caplog.text


@confined
def test_a_sandbox_that_cannot_be_set_up_says_so_in_the_log(monkeypatch, caplog):
    """Every call's setup failing (a container without CAP_SETUID, uid 65534 unmapped in a user namespace) answered
    the model an error and logged nothing: the operator never learnt why the tool never worked."""
    real_settings = python_sandbox.child_settings

    def settings_with_a_missing_directory(*args, **kwargs):
        settings = real_settings(*args, **kwargs)
        return {**settings, "workdir": settings["workdir"] + "-missing"}  # the child cannot confine itself to it

    monkeypatch.setattr(python_sandbox, "child_settings", settings_with_a_missing_directory)
    with caplog.at_level(logging.WARNING, logger=python_sandbox.__name__):
        tool = python_tool(LIMITS)
    assert tool.call({"code": "print(1)"}).startswith("error: the sandbox could not be set up")
    logged = [r for r in caplog.records if "could not be set up" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR, caplog.text
    monkeypatch.undo()
    still_works()


# A sampler whose mounts an LSM refuses though it holds CAP_SYS_ADMIN (AppArmor's docker-default profile denies
# mount; --cap-add SYS_ADMIN is common on GPU nodes, for profilers): a seccomp filter of its own makes mount() fail
# with EACCES, as AppArmor does, in it and in the sandbox children it starts.
MOUNTS_REFUSED = """
import ctypes, json, logging, os, sys
from grpo_stream.common.tools import sandbox_child as child
from grpo_stream.common.tools.python_sandbox import SandboxLimits, python_tool, run_python
arch = child.SECCOMP_ARCHES[os.uname().machine][0]
mount = {"x86_64": 165, "aarch64": 40}[os.uname().machine]
allow, refuse = (child.BPF_RET_K, 0, 0, child.SECCOMP_RET_ALLOW), (child.BPF_RET_K, 0, 0, child.SECCOMP_RET_ERRNO | 13)
program = [(child.BPF_LD_W_ABS, 0, 0, 4), (child.BPF_JEQ_K, 1, 0, arch), allow,  # another ABI: not ours to judge
           (child.BPF_LD_W_ABS, 0, 0, 0), (child.BPF_JEQ_K, 0, 1, mount), refuse, allow]
filters = (child.SockFilter * len(program))(*[child.SockFilter(*instruction) for instruction in program])
library = child.libc()
assert library.prctl(child.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
assert library.prctl(child.PR_SET_SECCOMP, child.SECCOMP_MODE_FILTER,
                     ctypes.byref(child.SockFprog(len(program), filters)), 0, 0) == 0
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
limits = SandboxLimits(cpu_seconds=1, wall_seconds=6)
python_tool(limits)
result = run_python("print(6 * 7)\\ntry:\\n    open('x', 'w')\\nexcept OSError as e:\\n    print(e.errno)", limits)
print(json.dumps([result.stdout, result.error]))
"""


@confined
@pytest.mark.skipif(os.uname().machine not in sandbox_child.SECCOMP_ARCHES, reason="no seccomp filter here")
def test_refused_mounts_leave_a_read_only_directory_and_say_so():
    """The child stopped every call ("could not make the call's mounts private: Permission denied") when an LSM
    refused mount() after unshare() succeeded: the tool never ran. Nothing mounted, the directory is read-only to the
    code (as without CAP_SYS_ADMIN), and the sampler's log says its calls cannot write."""
    if python_sandbox.read_only_reason() is not None:
        pytest.skip(f"the calls get no tmpfs here anyway: {python_sandbox.read_only_reason()}")
    done = subprocess.run([sys.executable, "-c", MOUNTS_REFUSED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["42\n13\n", None], done  # it ran; EACCES on a write in its directory
    assert "WARNING the Python tool's calls get no bounded tmpfs" in done.stderr and "cannot run" not in done.stderr
