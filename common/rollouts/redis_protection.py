"""What makes an embedded Redis protected (`up`'s and `audit`'s, on a run's data): the password file the run's
clients read, and the admin commands renamed away (common/rollouts/redis_server.py: EmbeddedRedis)."""

from __future__ import annotations

import os
import pathlib

PASSWORD_FILE = "redis.password"  # in a protected EmbeddedRedis's data directory: the run's clients read it there
# commands no client of grpo-stream sends, renamed away on a protected embedded Redis: with them a client holding the
# password could write files as the run's user (CONFIG SET dir + SAVE), load code (MODULE LOAD; REPLICAOF a server
# of its own, whose replication stream can do the same), inspect or crash the server (DEBUG), or stop or wipe the
# buffer (SHUTDOWN, FLUSHALL)
RENAMED_AWAY = ("DEBUG", "MODULE", "SAVE", "BGSAVE", "BGREWRITEAOF", "SHUTDOWN", "REPLICAOF", "SLAVEOF", "SYNC",
                "PSYNC", "FAILOVER", "MIGRATE", "ACL", "FLUSHALL", "FLUSHDB", "MONITOR")


def protected_config(password: str, config_command: str) -> str:
    """redis.conf lines of a protected embedded Redis: its password, protected mode, CONFIG under the secret name
    `config_command` and RENAMED_AWAY under none."""
    lines = [f"requirepass {password}", "protected-mode yes", f"rename-command CONFIG {config_command}"]
    lines += [f'rename-command {name} ""' for name in RENAMED_AWAY]
    return "\n".join(lines) + "\n"


def read_password(data_dir: str | os.PathLike) -> str | None:
    """The password a protected embedded Redis on `data_dir` was started with (None: none there)."""
    try:
        return pathlib.Path(data_dir, PASSWORD_FILE).read_text().strip() or None
    except OSError:
        return None
