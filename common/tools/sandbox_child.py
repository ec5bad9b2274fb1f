"""The Python tool's child process: confines itself, then runs the model's code (docs/tools.md, threat model).

python_sandbox.py runs this file's text as `python -I -S -u -c <text> <settings JSON>` in a fresh working directory
and writes the code to its stdin. It is stdlib only and imports nothing of grpo_stream: -I and -S keep the sampler's
environment and site-packages off sys.path. Everything is done here, in the child, rather than in a preexec_fn,
because the sampler forks from a thread pool, where a preexec_fn can deadlock on a lock another thread held.

The order matters:
1. read the code (stdin) and import the modules the code may use (PRELOAD): once the uid is dropped, an installation
   only root can read (pyenv under /root) cannot be read any more, so what is imported now is what works;
2. resource limits (CPU, address space, file size, open files, no core, processes); as root, a fresh IPC namespace
   and the working directory as a bounded tmpfs in a private mount namespace (private_workdir);
3. no_new_privs, then Landlock (needs it): read beneath the Python installation and the shared-library folders,
   read/write beneath the working directory only, no TCP bind/connect (ABI >= 4), signals and abstract unix sockets
   scoped to the sandbox (ABI >= 6). The rules are built while still root: the paths must be opened to be named;
4. as root: drop to nobody (setgroups, setresgid, setresuid); root ignores RLIMIT_NPROC, and nobody owns nothing;
5. a seccomp filter: no socket(), SysV IPC, POSIX message queues, keys, io_uring, setsid/setpgid (the process group
   kill must reach every process), unshare or clone into new namespaces (new user namespaces add kernel attack
   surface) or as the sampler's child; no chmod, chown, utime, xattr changes (ACLs) or truncate by path (Landlock has
   no right for them: they reach the same uid's files anywhere); nothing that acts on another process by pid or pidfd
   (prlimit, kill, setpriority, sched_*, ptrace, ...) or makes it a file's owner (fcntl F_SETOWN, ioctl FIOSETOWN:
   SIGIO on that file's I/O): a non-root sampler's child keeps its uid, and the kernel lets a process of the same uid
   change the sampler's limits or priority, or signal it (Landlock scopes signals only from ABI 6 and has no hook for
   prlimit or setpriority);
6. run the code in a fresh namespace; a traceback is printed without this file's frames.

Exit code SETUP_FAILED with a line "sandbox: ..." on stderr: a step failed and the code did not run (fail closed).
"""

import builtins
import ctypes
import json
import linecache
import os
import resource
import stat
import sys
import traceback  # imported before confinement, like PRELOAD: run() needs it after the uid drop

SETUP_FAILED = 125
# What the code may import even where the installation is unreadable to nobody (step 1): computation, text, data.
PRELOAD = ("array", "base64", "bisect", "calendar", "cmath", "collections", "copy", "dataclasses", "datetime",
           "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "itertools", "json", "math", "numbers",
           "operator", "pprint", "random", "re", "statistics", "string", "struct", "textwrap", "time", "typing",
           "unicodedata")
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # the same on every arch
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
(FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR, FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR,
 FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV) = (
    1 << bit for bit in range(16))
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # all a rule on a file may hold
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
X32_SYSCALL_BIT = 0x40000000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
# machine: (AUDIT_ARCH_*, its column in SYSCALL_NUMBERS)
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
# name: (x86_64, aarch64), from asm/unistd_64.h and asm-generic/unistd.h (tests check them against the headers)
SYSCALL_NUMBERS = {
    "socket": (41, 198), "io_uring_setup": (425, 425), "setsid": (112, 157), "setpgid": (109, 154),
    "unshare": (272, 97), "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "process_madvise": (440, 440), "pidfd_open": (434, 434), "pidfd_send_signal": (424, 424),
    "pidfd_getfd": (438, 438), "perf_event_open": (298, 241), "kill": (62, 129), "tkill": (200, 130),
    "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240),
    "sched_setparam": (142, 118), "sched_setscheduler": (144, 119), "sched_setaffinity": (203, 122),
    "sched_setattr": (314, 274), "migrate_pages": (256, 238), "move_pages": (279, 239), "setpriority": (141, 140),
    "ioprio_set": (251, 30), "prlimit64": (302, 261),
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "semget": (64, 190), "semop": (65, 193),
    "semctl": (66, 191), "semtimedop": (220, 192), "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188),
    "msgctl": (71, 187), "mq_open": (240, 180), "mq_unlink": (241, 181), "mq_timedsend": (242, 182),
    "mq_timedreceive": (243, 183), "mq_notify": (244, 184), "mq_getsetattr": (245, 185), "add_key": (248, 217),
    "request_key": (249, 218), "keyctl": (250, 219), "memfd_create": (319, 279), "prctl": (157, 167),
    "fcntl": (72, 25), "ioctl": (16, 29), "chmod": (90, None), "fchmod": (91, 52), "fchmodat": (268, 53),
    "fchmodat2": (452, 452), "chown": (92, None), "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54),
    "truncate": (76, 45), "utime": (132, None), "utimes": (235, None), "futimesat": (261, None),
    "utimensat": (280, 88), "clone": (56, 220), "clone3": (435, 435), "setxattr": (188, 5), "lsetxattr": (189, 6),
    "fsetxattr": (190, 7), "removexattr": (197, 14), "lremovexattr": (198, 15), "fremovexattr": (199, 16),
    "setxattrat": (463, 463), "removexattrat": (466, 466)}  # None: no such call (aarch64: *at only)
# Always EPERM: no network, io_uring, leaving the process group, namespaces; every call that reaches another process
# through a pid or pidfd without a use for computation (ptrace, reading its memory, perf, pidfds); and the kernel
# objects that outlive a process and that Landlock does not cover: SysV shared memory, semaphores and message queues,
# POSIX message queues, keys (a segment left behind stays resident for the machine's life; a later call could read it).
SECCOMP_DENIED = ("socket", "io_uring_setup", "setsid", "setpgid", "unshare", "ptrace", "process_vm_readv",
                  "process_vm_writev", "kcmp", "process_madvise", "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
                  "perf_event_open", "shmget", "shmat", "shmctl", "semget", "semop", "semctl", "semtimedop", "msgget",
                  "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive",
                  "mq_notify", "mq_getsetattr", "add_key", "request_key", "keyctl", "memfd_create", "chmod", "fchmod",
                  "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "truncate", "utime", "utimes",
                  "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr",
                  "fremovexattr", "setxattrat", "removexattrat")
# memfd_create: an anonymous file's pages count against no rlimit until mapped (RLIMIT_AS does not see them), so 64
# descriptors of 16 MB each held a gigabyte of the machine's memory per call.
# chmod, chown, utime, xattrs (truncate by path before ABI 3) have no Landlock right: a non-root sampler's child (its
# uid) made 0600 tokens world-readable (by chmod, or an ACL: system.posix_acl_access) or the run directory unusable.
PR_SET_PDEATHSIG = 1
# Calls refused when their first argument is this value: prctl(PR_SET_PDEATHSIG), which would clear the signal that
# kills the child when the sampler dies (a sleeping call, which uses no CPU, would otherwise outlive it for ever).
SECCOMP_DENIED_ARG0 = {"prctl": PR_SET_PDEATHSIG}
CLONE_PARENT, CLONE_NEWS = 0x8000, 0x7E020000  # CLONE_NEWNS and CLONE_NEWCGROUP .. CLONE_NEWNET
# With max_processes > 0, clone's flags are refused for: CLONE_PARENT, which made the new process the sampler's
# child (never reaped: each call left zombies in the sampler, which also kept the uid's RLIMIT_NPROC places, so
# later calls could not fork at all), and the CLONE_NEW* namespaces, unshare's by another door. The kernel reads the
# flags' low half only. clone3 passes its flags in memory, which a filter cannot read: it fails with ENOSYS, on
# which glibc falls back to clone.
SECCOMP_DENIED_FLAGS = {"clone": (0, CLONE_PARENT | CLONE_NEWS)}
SECCOMP_ENOSYS = ("clone3",)
F_SETOWN, F_SETOWN_EX, FIOSETOWN, SIOCSPGRP = 8, 15, 0x8901, 0x8902
# A file's owner gets SIGIO (default action: terminate) on the file's I/O, sent with the rights of whoever set the
# owner: the code could make a same-uid sampler the owner of its stdout pipe (the sampler's reads then signal it) or
# of a socketpair, and kill it where Landlock does not scope signals (ABI < 6, Linux < 6.12). name: (the argument
# holding the command, {command: the argument holding the owner's pid, or None where it is behind a pointer and
# always refused}). The kernel reads the command and the pid as 32-bit ints: only their low halves are compared.
SECCOMP_FILE_OWNER = {"fcntl": (1, {F_SETOWN: 2, F_SETOWN_EX: None}), "ioctl": (1, {FIOSETOWN: None, SIOCSPGRP: None})}
PRIO_PROCESS, IOPRIO_WHO_PROCESS = 0, 1
# Calls that act on the process a pid names, allowed only on the sandbox itself: name: (the pid's argument, whether
# the child's own pid is allowed besides 0, the value arg0 must hold (the "which" of setpriority/ioprio_set: one
# process, not a group or a user) or None). A same-uid sampler could otherwise have its limits, priority, affinity
# or scheduling changed, or be signalled where Landlock's signal scoping (ABI >= 6) is missing. prlimit64 only on
# pid 0: getrlimit/setrlimit use that.
SECCOMP_OWN_PID = {**dict.fromkeys(("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "sched_setparam",
                                    "sched_setscheduler", "sched_setaffinity", "sched_setattr", "migrate_pages",
                                    "move_pages"), (0, True, None)),
                   "setpriority": (1, True, PRIO_PROCESS), "ioprio_set": (1, True, IOPRIO_WHO_PROCESS),
                   "prlimit64": (0, False, None)}
SHARED_LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def libc():
    library = ctypes.CDLL(None, use_errno=True)
    library.syscall.restype = ctypes.c_long
    return library


def syscall(library, number, *args):
    """A raw syscall; every integer is passed as a full long (the variadic ABI leaves a C int's upper bits open)."""
    values = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = library.syscall(ctypes.c_long(number), *values)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def landlock_abi():
    """The kernel's Landlock ABI version; 0 where there is none (old kernel, or landlock not among the LSMs)."""
    try:
        return syscall(libc(), LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    except OSError:
        return 0


def fail(message):
    sys.stderr.write(f"sandbox: {message}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def lower_limit(which, value):
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def set_limits(settings):
    cpu = settings["cpu_seconds"]
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1 if hard == resource.RLIM_INFINITY else min(cpu + 1, hard)))
    lower_limit(resource.RLIMIT_AS, settings["memory_bytes"])
    lower_limit(resource.RLIMIT_FSIZE, settings["file_bytes"])
    lower_limit(resource.RLIMIT_NOFILE, 64)
    lower_limit(resource.RLIMIT_CORE, 0)
    lower_limit(resource.RLIMIT_NPROC, settings["max_processes"])


def landlock_rules(abi, workdir, writable=True):
    """(path, rights) pairs: read beneath the interpreter's import path and the shared libraries, read/write beneath
    the working directory (read only when not `writable`), /dev/null and /dev/urandom; nothing else (no /tmp, /proc,
    home or run directory)."""
    read = FS_READ_FILE | FS_READ_DIR
    write = (read | FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SYM
             | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0))
    library = os.path.join(sys.base_prefix, "lib")  # libpython and what the build linked beside it
    reads = [p for p in (*sys.path, library, *SHARED_LIBRARY_DIRS) if p and os.path.isabs(p)]
    return ([(path, read) for path in reads] + [("/dev/urandom", FS_READ_FILE)]
            + [("/dev/null", FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)),
               (workdir, write if writable else read)])


def apply_landlock(workdir, writable=True):
    abi = landlock_abi()
    if abi < 1:
        fail("this kernel has no Landlock")
    handled_fs = (1 << 13) - 1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (
        FS_IOCTL_DEV if abi >= 5 else 0)
    attr = RulesetAttr(handled_fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)  # TCP bind+connect; scopes
    library = libc()
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the fields this ABI knows (later ones must not be sent)
    ruleset = syscall(library, LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    for path, rights in landlock_rules(abi, workdir, writable):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            if path == workdir:
                raise
            continue  # a folder this system does not have (/lib64, python311.zip)
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                rights &= FILE_RIGHTS
            rule = PathBeneathAttr(rights & handled_fs, fd)
            syscall(library, LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        finally:
            os.close(fd)
    syscall(library, LANDLOCK_RESTRICT_SELF, ruleset, 0)
    os.close(ruleset)


def seccomp_program(machine, own_pid):
    """The filter as (code, jt, jf, k) instructions. Another ABI than the machine's kills the process; x32 calls and
    SECCOMP_DENIED fail with EPERM; a SECCOMP_OWN_PID call is allowed only when its pid argument is 0 or own_pid
    (where allowed) and its "which" is one process; a SECCOMP_FILE_OWNER command only with no owner or the sandbox
    as the owner (file_owner_checks); a SECCOMP_DENIED_FLAGS call only without those flags; SECCOMP_ENOSYS calls
    fail with ENOSYS; everything else is allowed. BPF sees a 64-bit argument as two 32-bit halves (low half first
    on these little-endian ABIs): for SECCOMP_OWN_PID both are compared, so -1 (every process), -pgid (a process
    group) and a pid with stray high bits are all refused."""
    audit_arch, column = SECCOMP_ARCHES[machine]
    number = {name: numbers[column] for name, numbers in SYSCALL_NUMBERS.items()}
    program = [(BPF_LD_W_ABS, 0, 0, 4), (BPF_JEQ_K, 1, 0, audit_arch), (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
               (BPF_LD_W_ABS, 0, 0, 0), (BPF_JGE_K, "deny", 0, X32_SYSCALL_BIT)]  # load nr; x32: deny
    program += [(BPF_JEQ_K, "deny", 0, number[name]) for name in SECCOMP_DENIED if number[name] is not None]
    program += [(BPF_JEQ_K, "enosys", 0, number[name]) for name in SECCOMP_ENOSYS]
    program += [(BPF_JEQ_K, name, 0, number[name])
                for name in (*SECCOMP_OWN_PID, *SECCOMP_DENIED_ARG0, *SECCOMP_FILE_OWNER, *SECCOMP_DENIED_FLAGS)]
    program.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    for name, (argument, flags) in SECCOMP_DENIED_FLAGS.items():
        program += [name, (BPF_LD_W_ABS, 0, 0, 16 + 8 * argument), (BPF_JSET_K, "deny", "allow", flags)]
    program += file_owner_checks(own_pid)
    for name, value in SECCOMP_DENIED_ARG0.items():
        program += [name, (BPF_LD_W_ABS, 0, 0, 20), (BPF_JEQ_K, 0, "allow", 0),  # args[0]'s high half 0 and
                    (BPF_LD_W_ABS, 0, 0, 16), (BPF_JEQ_K, "deny", "allow", value)]  # its low half the value: deny
    for name, (argument, own_allowed, which) in SECCOMP_OWN_PID.items():
        program.append(name)  # a label: the checks of this call
        if which is not None:
            program += [(BPF_LD_W_ABS, 0, 0, 20), (BPF_JEQ_K, 0, "deny", 0),  # args[0]: high half 0, low == which
                        (BPF_LD_W_ABS, 0, 0, 16), (BPF_JEQ_K, 0, "deny", which)]
        low = 16 + 8 * argument  # offsetof(struct seccomp_data, args[argument])
        program += [(BPF_LD_W_ABS, 0, 0, low + 4), (BPF_JEQ_K, 0, "deny", 0), (BPF_LD_W_ABS, 0, 0, low),
                    (BPF_JEQ_K, "allow", 0 if own_allowed else "deny", 0)]
        if own_allowed:
            program.append((BPF_JEQ_K, "allow", "deny", own_pid))
    program += ["allow", (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), "deny", (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),
                "enosys", (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]
    return resolve_labels(program)


def file_owner_checks(own_pid):
    """The labelled checks of SECCOMP_FILE_OWNER: a command that names an owner is allowed only with pid 0 (no owner)
    or the sandbox's own; one whose pid is behind a pointer is refused; every other command is allowed."""
    program = []
    for name, (command_argument, commands) in SECCOMP_FILE_OWNER.items():
        program += [name, (BPF_LD_W_ABS, 0, 0, 16 + 8 * command_argument)]
        for command, pid_argument in commands.items():
            target = "deny" if pid_argument is None else f"{name} {command} pid"
            program.append((BPF_JEQ_K, target, 0, command))
        program.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
        for command, pid_argument in commands.items():
            if pid_argument is not None:
                program += [f"{name} {command} pid", (BPF_LD_W_ABS, 0, 0, 16 + 8 * pid_argument),
                            (BPF_JEQ_K, "allow", 0, 0), (BPF_JEQ_K, "allow", "deny", own_pid)]
    return program


def resolve_labels(program):
    """Replaces the string labels in a program (and in its jump fields) by BPF's forward jump offsets (0..255)."""
    targets, instructions = {}, []
    for item in program:
        if isinstance(item, str):
            targets[item] = len(instructions)
        else:
            instructions.append(item)
    resolved = []
    for index, (code, jt, jf, k) in enumerate(instructions):
        jt, jf = (targets[j] - index - 1 if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise ValueError(f"seccomp: jump out of range at instruction {index}")
        resolved.append((code, jt, jf, k))
    return resolved


def apply_seccomp():
    program = seccomp_program(os.uname().machine, os.getpid())
    filters = (SockFilter * len(program))(*[SockFilter(*instruction) for instruction in program])
    fprog = SockFprog(len(program), filters)
    if libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp: " + os.strerror(ctypes.get_errno()))


CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18


def private_workdir(settings):
    """As root: a fresh IPC namespace (no SysV object of the machine is visible, none made here outlives the call)
    and a mount namespace in which the working directory is a tmpfs of `disk_bytes` and `max_files` inodes (files
    and directories), owned by the user the code runs as. Both end with the call's last process: nothing it wrote
    stays. False where the kernel or an LSM refuses (no CAP_SYS_ADMIN; AppArmor's docker-default denies mount with
    it): nothing was mounted, and the plain directory is read-only to the code (confine): nothing bounds it."""
    library = libc()
    if library.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        return False
    if library.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # no mount reaches the machine's namespace:
        return False  # else the tmpfs would appear in it (shared propagation)
    uid, gid = settings["user"]
    options = (f"size={settings['disk_bytes']},nr_inodes={settings['max_files']},mode=0700,uid={uid},gid={gid}")
    workdir = settings["workdir"].encode()
    if library.mount(b"tmpfs", workdir, b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()) != 0:
        return False
    os.chdir(settings["workdir"])  # the cwd was the directory beneath the mount
    return True


def confine(settings):
    set_limits(settings)
    bounded = settings["user"] is not None and private_workdir(settings)
    if libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("prctl(PR_SET_NO_NEW_PRIVS) failed")
    if settings["confine"]:
        apply_landlock(settings["workdir"], writable=bounded)
    if settings["user"] is not None:
        uid, gid = settings["user"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            fail(f"could not drop to uid {uid}")
    # after the uid change, which clears it: the sampler's death (SIGKILL, OOM) kills the call with it, even one
    # asleep (no CPU used, no limit met); a parent already gone is checked for after
    if libc().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0 or os.getppid() != settings["parent"]:
        fail("the sampler is gone, or the parent-death signal could not be set")
    if settings["seccomp"]:  # off only in tests that check the Landlock layer alone
        apply_seccomp()


def run(code):
    """Runs the code as a __main__ module; an exception prints its traceback (the code's frames only), exit 1."""
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # source lines in tracebacks
    builtins.exit = builtins.quit = sys.exit  # -S leaves them out; models call them
    sys.argv = ["<code>"]
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever the code raised is reported, not re-raised
        namespace.clear()  # a MemoryError's data goes first, so that the traceback can be printed
        frames = exc.__traceback__
        while frames is not None and frames.tb_frame.f_code.co_filename != "<code>":
            frames = frames.tb_next
        try:
            traceback.clear_frames(frames)
            traceback.print_exception(type(exc), exc, frames)
        except MemoryError:
            os.write(2, f"{type(exc).__name__}\n".encode())
        sys.exit(1)


def main():
    settings = json.loads(sys.argv[1])
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass  # a build without it (no _decimal, no _hashlib): the code cannot use it either way
    try:
        confine(settings)
    except (OSError, ValueError) as exc:
        fail(f"{type(exc).__name__}: {exc}")
    run(code)


if __name__ == "__main__":
    main()
