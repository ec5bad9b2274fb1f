"""Authenticated, typed messages between the processes of a multi-process trainer (trainer.processes > 1).

Process 0 tells the others what they cannot decide alone (multihost.py) through the key-value store of JAX's
coordination service, and its config's digests (which every other process checks its own against); every process
announces where it serves each weight version there. That store has no access control: anything that reaches the
coordinator port can read, write, overwrite and list its keys. So every value written there is sealed here:

- an HMAC-SHA256 with the job's secret (GRPO_STREAM_TRAINER_SECRET or GRPO_STREAM_TRAINER_SECRET_FILE; `up` makes
  one per start of the job) over the whole frame: the incarnation, the stream, the sequence number, the kind, the
  fields and the arrays; a value without the right MAC is never parsed further;
- the incarnation (16 random bytes process 0 draws at each start and broadcasts over the job's own collective, so
  a message recorded at an earlier start of the job never verifies in a later one even with a long-lived secret);
- the sequence number (each message's position in its stream: a replayed or reordered message is refused);
- a kind from a fixed set, with fields checked by a pydantic model (extra fields refused) and arrays loaded without
  pickle;
- a key name derived from the secret, the incarnation, the stream and the sequence number: nobody without the
  secret can write a key before its writer does (so a pre-written key can never be read first), nor guess where
  the next message will be.

What this does not stop: a writer on the coordinator port can still overwrite or delete a value after it was
written, or disturb the coordination service itself (a denial of service). An overwritten value stops its reader
with ControlMessageError and the job restarts; a deleted one is never read, so its reader waits for it and process 0
in the step's collective until a supervisor restarts the hung job (`up`: up.trainer_stall_s; a JobSet has no such
watch). Keep the coordinator port reachable by the job's processes only (`up` binds it to loopback; on Kubernetes,
a NetworkPolicy).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import secrets
import stat
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

SECRET_ENV = "GRPO_STREAM_TRAINER_SECRET"  # the secret itself (how `up` hands it to its trainer processes)
SECRET_FILE_ENV = "GRPO_STREAM_TRAINER_SECRET_FILE"  # ... or a file holding it (a Kubernetes Secret, mode 0400)
MIN_SECRET_CHARS = 32
_MAGIC = b"GRPOMSG1"
_MAC_BYTES = 32
_MAX_HEADER = 1 << 20
# an authentic message this process cannot read: its writer runs another version of grpo-stream
_SKEW = " (the trainer processes run different versions of grpo-stream: install the same one on every host)"


class ControlMessageError(RuntimeError):
    """A value in the coordination service's store that is not an authentic message of this job where one was
    expected (or one that came out of order): never acted on."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Start(_Message):
    kind: Literal["start"] = "start"
    epoch: str = Field(min_length=1, max_length=128)  # process 0's trainer epoch: the versions published are its
    restore: int | None = Field(None, ge=0)  # the checkpoint step every process restores (None: none, start anew)


class Step(_Message):
    kind: Literal["step"] = "step"
    step: int = Field(ge=1)
    checkpoint: bool
    publish: bool


class Finish(_Message):
    kind: Literal["finish"] = "finish"
    steps: int = Field(ge=0)
    complete: bool
    checkpoint: bool
    publish: bool


class Done(_Message):
    kind: Literal["done"] = "done"


class Settings(_Message):
    """Process 0's resolved config as keyed digests, one per setting (multihost.check_same_config): each process
    compares its own, and no value can be read (or guessed) from the store."""
    kind: Literal["settings"] = "settings"
    digests: dict[str, str] = Field(max_length=1 << 14)


class Hosts(_Message):
    """Where one trainer process serves its slices of one weight version."""
    kind: Literal["hosts"] = "hosts"
    epoch: str = Field(min_length=1, max_length=128)
    version: int = Field(ge=-1)  # -1: a LoRA run's frozen base
    process: int = Field(ge=0)
    address: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    data_port: int = Field(ge=0, le=65535)


# what each stream may carry: process 0's messages to the others, and every process's announcements
STREAMS: dict[str, TypeAdapter] = {
    "msg": TypeAdapter(Annotated[Union[Start, Step, Finish, Done], Field(discriminator="kind")]),
    "hosts": TypeAdapter(Hosts),
    "settings": TypeAdapter(Settings),
}
KINDS = {"msg": ("start", "step", "finish", "done"), "hosts": ("hosts",), "settings": ("settings",)}


def new_secret() -> str:
    """A fresh secret for one start of a trainer job (64 hex characters)."""
    return secrets.token_hex(32)


def load_secret(environ: dict[str, str] | None = None) -> bytes:
    """The job's secret from $GRPO_STREAM_TRAINER_SECRET or the file named by $GRPO_STREAM_TRAINER_SECRET_FILE;
    ValueError naming the setting when it is missing, short, or in a file other users can read."""
    env = os.environ if environ is None else environ
    value, setting = env.get(SECRET_ENV), SECRET_ENV
    if not value and env.get(SECRET_FILE_ENV):
        path, setting = env[SECRET_FILE_ENV], f"{SECRET_FILE_ENV}={env[SECRET_FILE_ENV]}"
        try:
            mode = os.stat(path).st_mode
            value = open(path, encoding="utf-8").read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{setting}: cannot read the trainer processes' shared secret ({exc})") from exc
        if mode & (stat.S_IRWXO | stat.S_IWGRP):
            raise ValueError(f"{setting}: the file is readable or writable by other users (mode "
                             f"{stat.S_IMODE(mode):04o}); chmod 600 it (a Kubernetes Secret: defaultMode 0400)")
    if not value:
        raise ValueError(f"a trainer of several processes (trainer.processes > 1) authenticates the messages between "
                         f"its processes with a secret they share: set {SECRET_FILE_ENV} to a file of at least "
                         f"{MIN_SECRET_CHARS} random characters (e.g. `openssl rand -hex 32`, mode 0600) or "
                         f"{SECRET_ENV} to the secret itself, the same for every process of the job "
                         "(`grpo-stream up` makes one for each start)")
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{setting}: the trainer processes' shared secret has {len(value)} characters; use at least "
                         f"{MIN_SECRET_CHARS} random ones (e.g. `openssl rand -hex 32`)")
    return value.encode()


class ControlCodec:
    """Seals and opens the values of one start of a trainer job (one secret, one incarnation)."""

    def __init__(self, secret: bytes, incarnation: bytes):
        self.incarnation = incarnation.hex()
        # separate keys for the MAC and the key names (a name is public once written; a MAC key must never be)
        self._mac_key = hmac.new(secret, b"grpo-stream trainer messages: mac", hashlib.sha256).digest()
        self._name_key = hmac.new(secret, b"grpo-stream trainer messages: names", hashlib.sha256).digest()
        self._digest_key = hmac.new(secret, b"grpo-stream trainer messages: digests", hashlib.sha256).digest()

    def digest(self, value: Any) -> str:
        """A keyed digest of `value` (JSON): equal values have equal digests, and without the secret nothing of the
        value can be learned from it, a guessable one included."""
        what = json.dumps(value, sort_keys=True).encode()
        return hmac.new(self._digest_key, what, hashlib.sha256).hexdigest()[:32]

    def key(self, stream: str, seq: int, *parts: Any) -> str:
        """Where value `seq` of `stream` lives: unguessable without the secret, fresh at every incarnation."""
        what = json.dumps([self.incarnation, stream, seq, *parts]).encode()
        return f"grpo/{stream}/{hmac.new(self._name_key, what, hashlib.sha256).hexdigest()[:40]}"

    def seal(self, stream: str, seq: int, message: _Message, arrays: dict[str, np.ndarray] | None = None) -> bytes:
        """The frame of `message` (and numpy `arrays`) as value `seq` of `stream`."""
        STREAMS[stream].validate_python(message)  # a kind this stream carries
        header = json.dumps({"incarnation": self.incarnation, "stream": stream, "seq": seq,
                             "message": message.model_dump(mode="json")}, separators=(",", ":")).encode()
        body = io.BytesIO()
        np.savez(body, **(arrays or {}))
        signed = len(header).to_bytes(4, "big") + header + body.getvalue()
        return _MAGIC + hmac.new(self._mac_key, _MAGIC + signed, hashlib.sha256).digest() + signed

    def open(self, stream: str, seq: int, raw: bytes, where: str) -> tuple[Any, dict[str, np.ndarray]]:
        """(message, arrays) of `raw`, read at `where` as value `seq` of `stream`; ControlMessageError naming the
        problem when it is not that."""
        def refuse(problem: str) -> ControlMessageError:
            return ControlMessageError(f"the value at {where} (expected: {stream} message {seq} of this start of the "
                                       f"job) {problem}; it is not acted on")
        head = len(_MAGIC) + _MAC_BYTES
        if len(raw) < head + 4 or not raw.startswith(_MAGIC):
            raise refuse("is not a sealed trainer message (something other than this job's trainer processes wrote "
                         "into the coordination service's key-value store)")
        signed = raw[head:]
        mac = hmac.new(self._mac_key, _MAGIC + signed, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, raw[len(_MAGIC):head]):
            raise refuse(f"fails authentication (bad MAC): it was forged or overwritten by something other than this "
                         f"job's trainer processes, or the processes hold different secrets ({SECRET_ENV} / "
                         f"{SECRET_FILE_ENV})")
        size = int.from_bytes(signed[:4], "big")
        try:
            if size > min(_MAX_HEADER, len(signed) - 4):
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(signed[4:4 + size])
            incarnation, got_stream, got_seq = header["incarnation"], header["stream"], header["seq"]
        except (ValueError, KeyError, TypeError) as exc:
            raise refuse(f"has a header that does not parse ({exc})") from exc
        if incarnation != self.incarnation:
            raise refuse(f"belongs to another start of the job (incarnation {str(incarnation)[:32]}, this one "
                         f"{self.incarnation}): a replayed message")
        if got_stream != stream or got_seq != seq:
            raise refuse(f"is {str(got_stream)[:16]} message {str(got_seq)[:20]}: a replayed or reordered message")
        return self._parse(stream, header.get("message"), signed[4 + size:], refuse)

    @staticmethod
    def _parse(stream: str, message: Any, body: bytes, refuse) -> tuple[Any, dict[str, np.ndarray]]:
        kind = message.get("kind") if isinstance(message, dict) else None
        if kind not in KINDS[stream]:
            raise refuse(f"is of kind {str(kind)[:32]!r}, not one of {', '.join(KINDS[stream])}{_SKEW}")
        try:
            parsed = STREAMS[stream].validate_python(message)
        except ValidationError as exc:
            raise refuse(f"has fields that do not parse as a {kind!r} message{_SKEW}: {str(exc)[:500]}") from exc
        try:
            with np.load(io.BytesIO(body), allow_pickle=False) as npz:  # never unpickles
                arrays = {name: npz[name] for name in npz.files}
        except (ValueError, OSError, EOFError) as exc:
            raise refuse(f"has arrays that do not load ({exc})") from exc
        return parsed, arrays
