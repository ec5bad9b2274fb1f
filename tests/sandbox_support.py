"""What the Python sandbox's integration tests share: the limits they run under, the secret they try to read,
the skip for machines that cannot confine, the check that the next call still works, and a process's children."""

import os
import time
import uuid

import pytest

from grpo_stream.common.tools.python_sandbox import SandboxLimits, SandboxResult, confinement_problem, run_python

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=6)  # wall room for 1 s of CPU on a busy machine
SECRET = "grpo-stream-token-" + uuid.uuid4().hex
confined = pytest.mark.skipif(confinement_problem() is not None, reason=f"cannot confine: {confinement_problem()}")


def still_works():
    assert run_python("print(6 * 7)", LIMITS) == SandboxResult("42\n", "", 0, None)


def timed(code: str, limits: SandboxLimits = LIMITS) -> tuple[SandboxResult, float]:
    start = time.monotonic()
    return run_python(code, limits), time.monotonic() - start


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            found.append(int(entry))
    return found
