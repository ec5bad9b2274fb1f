"""Who may call what: bearer tokens with roles, checked on every RPC of every service.

A token table maps tokens to a name (the caller's identity: quotas and ownership of injected prompts) and a role.
Each RPC lists the roles it accepts (ROLES_BY_METHOD, the one place that says so); a call without a valid token is
UNAUTHENTICATED, a valid token of the wrong role PERMISSION_DENIED (call_guard.py checks every call). Tokens are
looked up by SHA-256 digest and compared with `hmac.compare_digest` against every entry, so the time taken does not
depend on how much of a guess was right. The table holds digests only; a table file may store `sha256` instead of
the token itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import pathlib
import secrets
import tempfile
import threading
import time
from typing import Iterable

import grpc
import yaml

from grpo_stream.common.config.access import TOKEN_ENV, TOKEN_FILE_ENV, TOKENS_ENV

log = logging.getLogger(__name__)

ROLES = ("sampler", "client", "admin")
ANY = frozenset(ROLES)
SAMPLER = frozenset({"sampler", "admin"})
CLIENT = frozenset({"client", "admin"})
ADMIN = frozenset({"admin"})
HEALTH = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List")

# Every RPC any grpo-stream server exposes, with the roles it accepts. A method missing here is refused to all
# (PERMISSION_DENIED), so a new RPC cannot ship open by accident; tests/integration/test_auth.py checks that every
# method of every service is listed.
ROLES_BY_METHOD: dict[str, frozenset[str]] = {
    "/grpo_stream.v1.RolloutIngest/StreamBatches": SAMPLER,
    "/grpo_stream.v1.RolloutIngest/PushGroup": SAMPLER,
    "/grpo_stream.v1.RolloutIngest/GetDataPosition": SAMPLER,
    "/grpo_stream.v1.RolloutIngest/ClaimPrompts": SAMPLER,
    "/grpo_stream.v1.RolloutIngest/Admit": SAMPLER,
    "/grpo_stream.v1.WeightService/GetManifest": SAMPLER,
    "/grpo_stream.v1.WeightService/FetchSlices": SAMPLER,
    "/grpo_stream.v1.WeightService/ReportVersion": SAMPLER,
    "/grpo_stream.v1.PromptService/Submit": CLIENT,
    "/grpo_stream.v1.PromptService/StreamResults": CLIENT,
    "/grpo_stream.v1.PromptService/Cancel": CLIENT,
    "/grpo_stream.v1.PromptService/GetStatus": CLIENT,
    **{method: ANY for method in HEALTH},
    # a sampler's OpenAI-compatible HTTP endpoint (sampler.openai): routes by "VERB path"
    "GET /v1/models": CLIENT,
    "POST /v1/completions": CLIENT,
    "POST /v1/chat/completions": CLIENT,
    # reflection describes every service and message: for operators (grpcurl list/describe), not every token
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": ADMIN,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": ADMIN,
}
# The raw TCP weights data plane is not gRPC; it accepts what FetchSlices accepts.
DATA_PLANE = "/grpo_stream.v1.WeightService/FetchSlices"


class AuthError(ValueError):
    """A token table or token source that cannot be used; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class Caller:
    name: str
    role: str
    max_priority: int | None = None  # highest injected-prompt priority this token may use; None: prompts.max_priority


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Token digests -> Caller. A table read from a file follows the file: it is read again when it changed (checked
    at most every `check_s` seconds, at a lookup), so a token removed from it (revoked) or added to it (rotated in)
    counts without restarting the servers. An edit that cannot be used keeps the previous table, logged as an
    error naming the file, until the file is fixed."""

    check_s = 1.0

    def __init__(self, entries: Iterable[tuple[bytes, Caller]], source: tuple[pathlib.Path, str] | None = None):
        self._entries = list(entries)
        if not self._entries:
            raise AuthError("the token table is empty")
        self._source, self._lock = source, threading.Lock()
        self._signature = None if source is None else _signature(source[0])
        self._checked = time.monotonic()

    @classmethod
    def from_file(cls, path: str | os.PathLike, where: str = "auth.tokens_file") -> "TokenTable":
        path = pathlib.Path(path)
        signature = _signature(path)  # before reading: a write during the read is seen at the next check
        table = cls(_read_entries(path, where), (path, where))
        table._signature = signature
        return table

    def lookup(self, token: str) -> Caller | None:
        """The caller holding `token`; every entry is compared (constant time in which one matched)."""
        self._follow_file()
        digest, found = _digest(token), None
        for known, caller in self._entries:
            if hmac.compare_digest(known, digest):
                found = caller
        return found

    def _follow_file(self) -> None:
        if self._source is None or time.monotonic() - self._checked < self.check_s:
            return
        with self._lock:
            if time.monotonic() - self._checked < self.check_s:
                return
            self._checked = time.monotonic()
            path, where = self._source
            signature = _signature(path)
            if signature == self._signature:
                return
            self._signature = signature
            try:
                self._entries = _read_entries(path, where)
            except AuthError as exc:
                log.error("%s; the previous token table (%d tokens) stays in force until it is fixed", exc,
                          len(self._entries))
                return
            log.warning("%s=%s changed: %d tokens now", where, path, len(self._entries))


def _signature(path: pathlib.Path) -> tuple | None:
    """What changes when a file is edited or replaced (a Kubernetes Secret's swap of its symlink included)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns


def _read_entries(path: pathlib.Path, where: str) -> list[tuple[bytes, Caller]]:
    """A token table file's (digest, Caller) entries; AuthError naming `where` and the entry when unusable."""
    try:
        rows = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise AuthError(f"{where}={path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        # never the YAML error's own text: it quotes the offending line, which may hold a token
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(exc, "problem", None) or getattr(exc, "reason", None) or type(exc).__name__
        raise AuthError(f"{where}={path}: not valid YAML{at} ({why})") from None
    if not isinstance(rows, list) or not rows:
        raise AuthError(f"{where}={path}: must be a non-empty YAML list of {{name, role, token}} entries")
    entries, names, digests = [], set(), {}
    for i, row in enumerate(rows):
        digest, caller = _entry(row, i, f"{where}={path}")
        if caller.name in names:
            raise AuthError(f"{where}={path}: entry {i}: name {caller.name!r} appears twice (names identify callers)")
        if digest in digests:
            raise AuthError(f"{where}={path}: entry {i} ({caller.name}) has the token of entry {digests[digest]}; "
                            "each caller needs a token of its own (`grpo-stream tokens` makes them)")
        names.add(caller.name)
        digests[digest] = f"{i} ({caller.name})"
        entries.append((digest, caller))
    return entries


def _entry(row, i: int, where: str) -> tuple[bytes, Caller]:
    if not isinstance(row, dict) or set(row) - {"name", "role", "token", "sha256", "max_priority"}:
        raise AuthError(f"{where}: entry {i} must have keys name, role and token (or sha256), and may have "
                        "max_priority")
    name, role = str(row.get("name") or ""), row.get("role")
    if not name or role not in ROLES:
        raise AuthError(f"{where}: entry {i} needs a name and a role in {ROLES}")
    ceiling = row.get("max_priority")
    if ceiling is not None and (type(ceiling) is not int or ceiling < 0):
        raise AuthError(f"{where}: entry {i} ({name}): max_priority must be a whole number >= 0 (the highest "
                        "injected-prompt priority this token may use), or left out")
    if "token" in row:
        if not isinstance(row["token"], str):  # YAML read a number (or a date): 0x1f, 0123 or 1_000 as it, and
            # str() of that is another token than the one written, refused for ever with no word why
            raise AuthError(f"{where}: entry {i} ({name}): YAML reads the token as {type(row['token']).__name__}, "
                            "not as the text written; put it in quotes")
        token = row["token"]
        if len(token) < 16:
            raise AuthError(f"{where}: entry {i} ({name}): token shorter than 16 characters; use `grpo-stream "
                            "tokens` to make strong ones")
        return _digest(token), Caller(name, role, ceiling)
    try:
        digest = bytes.fromhex(str(row.get("sha256", "")))
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise AuthError(f"{where}: entry {i} ({name}): sha256 must be 64 hex digits")
    return digest, Caller(name, role, ceiling)


def load_table(auth) -> TokenTable | None:
    """The servers' token table for config section `auth` (None when auth.mode=none)."""
    if auth.mode == "none":
        log.warning("auth.mode=none: every RPC is open to anyone who can reach the port; use only on a trusted "
                    "network")
        return None
    path = os.environ.get(TOKENS_ENV) or auth.tokens_file
    if not path:
        raise AuthError(f"auth.mode=tokens but no token table: set ${TOKENS_ENV} or auth.tokens_file (`grpo-stream "
                        "tokens --out DIR` makes one), or auth.mode=none on a trusted network")
    return TokenTable.from_file(path, TOKENS_ENV if os.environ.get(TOKENS_ENV) else "auth.tokens_file")


def own_token(auth) -> str | None:
    """This process's token as a client: $GRPO_STREAM_TOKEN, else the file $GRPO_STREAM_TOKEN_FILE or
    auth.token_file; None when auth.mode=none."""
    if auth.mode == "none":
        return None
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    path = os.environ.get(TOKEN_FILE_ENV) or auth.token_file
    if not path:
        raise AuthError(f"auth.mode=tokens: this process needs a token; set ${TOKEN_ENV}, ${TOKEN_FILE_ENV} or "
                        "auth.token_file")
    try:
        token = pathlib.Path(path).read_text().strip()
    except OSError as exc:
        raise AuthError(f"{TOKEN_FILE_ENV if os.environ.get(TOKEN_FILE_ENV) else 'auth.token_file'}={path}: cannot "
                        f"read it ({exc.strerror})") from None
    if not token:
        raise AuthError(f"token file {path} is empty")
    return token


def bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def bearer_value(header: str | None) -> str | None:
    """The token of an HTTP Authorization header ("Bearer <token>"; the scheme in any case, as RFC 7235 reads it),
    or None."""
    if isinstance(header, str) and header[:7].lower() == "bearer " and header[7:].strip():
        return header[7:].strip()
    return None


def caller_refusal_http(caller: Caller | None, route: str) -> tuple[int, str] | None:
    """`caller_refusal` for an HTTP route ("VERB path"): (401 or 403, why), or None when it may proceed."""
    why = caller_refusal(caller, route)
    if why is None:
        return None
    if why[0] == grpc.StatusCode.UNAUTHENTICATED:
        return 401, "missing or unknown bearer token: send the header 'Authorization: Bearer <token>'"
    return 403, why[1]


def caller_of(context: grpc.ServicerContext, table: TokenTable | None) -> Caller:
    """The authenticated caller of an RPC (the interceptor has already checked it); `anonymous` without auth."""
    if table is None:
        return Caller("anonymous", "admin")
    token = bearer(context.invocation_metadata())
    found = table.lookup(token) if token else None
    return found or Caller("anonymous", "none")


def may_act_as(caller: Caller, sampler_id: str) -> bool:
    """Whether `caller` may speak for sampler `sampler_id` (push its groups, claim and admit under its id, read its
    data position). A sampler token named N acts for the sampler id N, or N-<k> (one token shared by samplers N-0,
    N-1, ...: what `grpo-stream tokens` and `up` hand out by default as 'sampler'); per-sampler tokens named
    sampler-0, sampler-1, ... (`grpo-stream tokens --samplers N`, and `up`) keep each sampler to its own id. Without
    this, any sampler token could push groups under another sampler's ids, which the buffer then refuses from the
    real sampler as duplicates: its groups would silently never be trained. k is 0..MAX_REPLICA in plain ASCII
    digits: the injected-prompt claim spreads prompts over the sampler ids active in the last minute (and reads them
    all at every claim), so one token claiming under unboundedly many ids would take most prompts and slow every
    claim. Admins (and a server without auth) act for anyone."""
    if caller.role == "admin":
        return True
    if caller.role != "sampler":
        return False
    suffix = sampler_id[len(caller.name) + 1:]
    return sampler_id == caller.name or (sampler_id.startswith(caller.name + "-") and _replica_index(suffix))


MAX_REPLICA = 4095  # the largest k of a shared sampler token's ids N-<k>


def _replica_index(suffix: str) -> bool:
    """Whether `suffix` is k of N-<k>: ASCII digits, no leading zero (one k, one id), at most MAX_REPLICA."""
    return (suffix.isascii() and suffix.isdigit() and (suffix == "0" or not suffix.startswith("0"))
            and int(suffix) <= MAX_REPLICA)


def refusal(table: TokenTable, token: str | None, method: str) -> tuple[grpc.StatusCode, str] | None:
    """Why a call of `method` (a ROLES_BY_METHOD key) with `token` is refused, or None when it may proceed."""
    return caller_refusal(table.lookup(token) if token else None, method)


def caller_refusal(caller: Caller | None, method: str) -> tuple[grpc.StatusCode, str] | None:
    """Why `caller` (None: no token or an unknown one) may not call `method`, or None when it may."""
    if caller is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                "missing or unknown bearer token: send metadata 'authorization: Bearer <token>'")
    allowed = ROLES_BY_METHOD.get(method, frozenset())
    if caller.role not in allowed:
        return (grpc.StatusCode.PERMISSION_DENIED, f"{method}: role {caller.role!r} ({caller.name}) may not call "
                f"it; it accepts {sorted(allowed) or 'no role'}")
    return None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_tokens(out_dir: pathlib.Path, names: dict[str, str] | None = None, samplers: int = 0
                 ) -> dict[str, pathlib.Path]:
    """A token table `tokens.yaml` plus one `<role>.token` file per role in `out_dir` (mode 0600); returns the
    paths by role and 'table'. `names`: role -> caller name (default: the role). `samplers`: also one token per
    sampler, `sampler-<i>.token` named sampler-<i>, each good for that sampler's id only (`may_act_as`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, 0o700)
    rows, paths = [], {}
    entries = [((names or {}).get(role, role), role, role) for role in ROLES]
    entries += [(f"sampler-{i}", "sampler", f"sampler-{i}") for i in range(samplers)]
    for name, role, key in entries:
        token = new_token()
        rows.append({"name": name, "role": role, "token": token})
        paths[key] = out_dir / f"{key}.token"
        write_private(paths[key], token + "\n")
    paths["table"] = out_dir / "tokens.yaml"
    write_private(paths["table"], yaml.safe_dump(rows, sort_keys=False))
    return paths


def write_private(path: pathlib.Path, text: str) -> None:
    """`text` as the whole of `path`, mode 0600 whatever the file was: written to a fresh 0600 file beside it, then
    renamed over it. So a file left with a looser mode (by hand, an older version) does not keep it, a symlink
    planted at `path` is replaced rather than followed (its target is not written), and a TokenTable following the
    file never reads it half-written (a shorter table, tokens revoked for a moment)."""
    path = pathlib.Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: 0600, O_EXCL
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the rename must not publish an empty file after a crash
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
