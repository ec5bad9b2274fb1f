"""The Python sandbox's parent as a non-root uid (the child then keeps that uid): the code cannot change the
parent's limits or priority, signal it (also through a file it makes the parent own), nor change the mode, owner,
times or size of that uid's files outside its directory; the seccomp filter itself is run on a small BPF
interpreter for both machines it is written for."""

import json
import os
import pathlib
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile

import pytest

from grpo_stream.common.tools import python_sandbox, sandbox_child
from grpo_stream.common.tools.python_sandbox import BOOTSTRAP, run_python
from tests.sandbox_support import LIMITS, confined, still_works


# The sandbox's parent as a non-root uid: the child keeps that uid, so only the seccomp filter (and, for signals,
# Landlock ABI >= 6) stops it from reaching the parent through its pid.
DRIVER = """
import json, os, resource, subprocess, sys
job = json.load(sys.stdin)
def state():
    return {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "cpu": resource.getrlimit(resource.RLIMIT_CPU),
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "affinity": sorted(os.sched_getaffinity(0))}
before = state()
settings = json.loads(job["settings"])
settings["parent"] = os.getpid()  # the sampler here: the child checks it is its parent
done = subprocess.run([sys.executable, "-I", "-S", "-u", "-c", job["bootstrap"], json.dumps(settings)],
                      input=job["code"],
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
                 "pidfd_open": "os.pidfd_open(parent)",
                 # the owner of a file gets SIGIO (default: terminate) on its I/O: of the stdout pipe, on each of the
                 # parent's reads; of a socketpair, on each send
                 "F_SETOWN": "fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL) | os.O_ASYNC); "
                             "fcntl.fcntl(1, fcntl.F_SETOWN, parent)",
                 "F_SETOWN group": "fcntl.fcntl(1, fcntl.F_SETOWN, -os.getpgid(parent))",
                 "F_SETOWN_EX": "fcntl.fcntl(1, 15, struct.pack('ii', 1, parent))",
                 "FIOSETOWN": "fcntl.ioctl(pair[1].fileno(), 0x5452, struct.pack('i', 1)); "  # FIOASYNC
                              "fcntl.ioctl(pair[1].fileno(), 0x8901, struct.pack('i', parent)); pair[0].send(b'x')",
                 "SIOCSPGRP": "fcntl.ioctl(pair[1].fileno(), 0x8902, struct.pack('i', parent)); pair[0].send(b'x')"}
ON_ITSELF = {"own prlimit": "resource.prlimit(0, resource.RLIMIT_NOFILE, (32, 32))",
             "own kill 0": "os.kill(os.getpid(), 0)", "own setpriority": "os.setpriority(os.PRIO_PROCESS, 0, 5)",
             "own F_SETOWN": "fcntl.fcntl(pair[0].fileno(), fcntl.F_SETOWN, os.getpid())"}


def attempts_code(attempts: dict[str, str]) -> str:
    """Code that tries each attempt and prints "<name> ALLOWED" or "<name> <errno>", then its own NOFILE limit."""
    code = "import os, resource\nparent = os.getppid()\n"
    if any("fcntl" in attempt for attempt in attempts.values()):  # not preloaded: a root pyenv's nobody lacks them
        code += "import fcntl, socket, struct\npair = socket.socketpair()\n"
    code += "".join(f"try:\n    {a}\n    print('{k} ALLOWED')\nexcept OSError as e:\n    print('{k}', e.errno)\n"
                    for k, a in attempts.items())
    return code + "print('own NOFILE', *resource.getrlimit(resource.RLIMIT_NOFILE))\n"


# sets no supplementary groups, then the gid and uid given, and execs the rest. subprocess's own user= and group=
# make it fork without vfork: in a pytest worker where an earlier test left gRPC running, gRPC's fork handlers
# restart its threads in the child, which crash it (SIGSEGV, SIGABRT) once subprocess closes their descriptors
SWITCH_USER = ("import os, sys; os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1])); "
               "os.execv(sys.argv[3], sys.argv[3:])")


def as_user_argv(argv: list[str], as_user: dict) -> list[str]:
    """`argv` run as `as_user` (from non_root_parent; {}: as this process)."""
    if not as_user:
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", SWITCH_USER, str(as_user["user"]), str(as_user["group"]), *argv]


def non_root_parent() -> tuple[str, dict]:
    """A Python, and the uid and gid (as_user_argv) that run it as a non-root uid: this process's own when it is not
    root, else uid/gid 65534 with a Python that uid can run (pyenv under /root is unreadable to it); skips when
    there is none."""
    if os.geteuid() != 0:
        return sys.executable, {}
    as_nobody = {"user": 65534, "group": 65534}
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            probe = subprocess.run(as_user_argv([python, "-I", "-c", "import json, resource, subprocess"], as_nobody),
                                   cwd="/", capture_output=True, timeout=30)
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
        done = subprocess.run(as_user_argv([python, "-I", "-c", DRIVER], as_user), input=job, cwd=workdir,
                              capture_output=True, text=True, timeout=60, start_new_session=True)
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


@pytest.fixture
def reachable_folder():
    """A folder the non-root uid can reach (pytest's tmp_path is beneath folders only root may enter)."""
    folder = tempfile.mkdtemp(prefix="grpo-stream-test-reachable-")
    os.chmod(folder, 0o755)
    yield pathlib.Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


# an access ACL of user::rw-, group::r--, other::r-- (the xattr's binary form): chmod 0644 by another door
ACL_0644 = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 0xFFFFFFFF) for tag, perm in
                                          ((0x01, 6), (0x04, 4), (0x20, 4)))
# fchmod, fsetxattr: on what the code may open to read (its directory here; the interpreter's files under a user's
# pyenv)
FILE_CHANGES = {"chmod": "os.chmod(target, 0o666)", "fchmod": "os.fchmod(os.open('.', os.O_RDONLY), 0o777)",
                "chown": "os.chown(target, os.getuid(), os.getgid())", "utime": "os.utime(target, (0, 0))",
                "truncate": "os.truncate(target, 0)",
                "acl": f"os.setxattr(target, 'system.posix_acl_access', {ACL_0644!r})",
                "xattr": "os.setxattr(target, 'user.note', b'x')",
                "fsetxattr": f"os.setxattr(os.open('.', os.O_RDONLY), 'system.posix_acl_access', {ACL_0644!r})",
                "removexattr": "os.removexattr(target, 'user.kept')"}


@confined
@pytest.mark.parametrize("confine", [True, False], ids=["landlock and seccomp", "seccomp alone"])
def test_a_non_root_sampler_files_keep_their_mode_and_contents(confine, reachable_folder):
    """Landlock has no right for chmod, chown, utime or xattrs (nor for truncate before ABI 3): they reach a file by
    its path wherever it is, and a non-root sampler's child keeps its uid, so it made the run directory's 0600 token
    readable to every user (also by an access ACL, set as an xattr). fchmod and fsetxattr reach a file the code may
    open to read (the interpreter's, under a user's pyenv)."""
    _, as_user = non_root_parent()
    target = reachable_folder / "client.token"
    target.write_text("secret")
    target.chmod(0o600)
    os.utime(target, (1e9, 1e9))
    os.setxattr(target, "user.kept", b"1")
    if as_user:
        os.chown(target, as_user["user"], as_user["group"])
    before = os.stat(target)
    code = f"target = {str(target)!r}\n" + attempts_code(FILE_CHANGES)
    report = run_under_non_root_parent(code, confine, seccomp=True)
    assert report["stdout"].splitlines()[:-1] == [f"{name} 1" for name in FILE_CHANGES], report
    after = os.stat(target)
    assert (after.st_mode, after.st_mtime, after.st_size) == (before.st_mode, before.st_mtime, before.st_size)
    assert os.listxattr(target) == ["user.kept"]


def evaluate_filter(program: list[tuple[int, int, int, int]], arch: int, number: int, *args: int) -> int:
    """Runs a seccomp program (the instructions sandbox_child uses) on one syscall; returns the action."""
    data = struct.pack("<iIQ6Q", number, arch, 0, *[a & (1 << 64) - 1 for a in (*args, *[0] * (6 - len(args)))])
    pc, accumulator = 0, None
    while True:
        code, jt, jf, k = program[pc]
        if code == sandbox_child.BPF_LD_W_ABS:
            accumulator, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (sandbox_child.BPF_JEQ_K, sandbox_child.BPF_JGE_K, sandbox_child.BPF_JSET_K):
            taken = {sandbox_child.BPF_JEQ_K: accumulator == k, sandbox_child.BPF_JGE_K: accumulator >= k,
                     sandbox_child.BPF_JSET_K: bool(accumulator & k)}[code]
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
        if sandbox_child.SYSCALL_NUMBERS[name][column] is not None:  # None: this machine has no such call
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
    f_setown, f_setown_ex, f_getfl, fiosetown, siocspgrp, tcgets = 8, 15, 3, 0x8901, 0x8902, 0x5401
    for pid in (parent, -parent, 1 << 32 | parent, -1):  # the kernel reads cmd and pid as ints: low halves only
        assert action("fcntl", 1, f_setown, pid) == action("fcntl", 1, f_setown | 1 << 32, pid) == deny, pid
    assert action("fcntl", 1, f_setown, 0) == action("fcntl", 1, f_setown, 1 << 32 | own) == allow
    assert action("fcntl", 1, f_setown_ex, 0) == action("fcntl", 1, f_setown_ex | 1 << 32, 0) == deny
    assert action("fcntl", 1, f_getfl, parent) == allow
    for command in (fiosetown, siocspgrp):
        assert action("ioctl", 1, command, 0) == action("ioctl", 1, command | 1 << 32, 0) == deny, command
    assert action("ioctl", 1, tcgets, 0) == allow
    fork, thread = 0x01200011, 0x003D0F00  # glibc's fork and pthread_create flags
    assert action("clone", fork) == action("clone", thread) == action("clone", 0x7E028000 << 32 | fork) == allow
    for flag in (0x8000, 0x10000000, 0x20000000, 0x40000000, 0x20000):  # PARENT, NEWUSER, NEWPID, NEWNET, NEWNS
        assert action("clone", fork | flag) == deny, hex(flag)
    assert action("clone3", 0, 88) == sandbox_child.SECCOMP_RET_ERRNO | sandbox_child.ENOSYS


@pytest.mark.parametrize("machine, header", [("x86_64", "x86_64-linux-gnu/asm/unistd_64.h"),
                                             ("aarch64", "asm-generic/unistd.h")])
def test_the_syscall_numbers_match_the_kernel_headers(machine, header):
    path = os.path.join("/usr/include", header)
    if not os.path.exists(path):
        pytest.skip(f"{path} is not installed (linux-libc-dev)")
    with open(path) as f:
        numbers = {name: int(n) for name, n in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", f.read())}
    column = sandbox_child.SECCOMP_ARCHES[machine][1]
    ours = {name: values[column] for name, values in sandbox_child.SYSCALL_NUMBERS.items()}
    # None: the machine has no such call; a call newer than these headers has a number >= 424, the same on every
    # machine since Linux 5.1 (fchmodat2, 452, came in 6.6)
    newer = {name for name, number in ours.items() if name not in numbers and number is not None and number >= 424}
    assert {name: number for name, number in ours.items() if name not in newer} == {
        name: numbers.get(name) for name in ours if name not in newer}
    assert all(sandbox_child.SYSCALL_NUMBERS[name] == (number, number) for name, number in ours.items()
               if name in newer)

