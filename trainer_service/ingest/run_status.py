"""The trainer's status record in Redis (P:R:status, rewritten every second) and GetStatus's reading of it."""

from __future__ import annotations

import logging
import threading
import time

from google.protobuf import json_format

from grpo_stream.common.rollouts.buffer import BufferUnavailable
from grpo_stream.protos import prompts_pb2
from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue

log = logging.getLogger(__name__)

_STATUS_FIELDS = {"step": "trainer_step", "total_steps": "total_steps", "latest_version": "latest_weight_version",
                  "updated_unix": "trainer_updated_unix"}


def fill_status(reply: prompts_pb2.RunStatus, status: dict, key: str) -> None:
    """`reply` with what the trainer's status record holds: each field and sampler entry that reads as its type; the
    others are left at their defaults and logged (Redis may be written by others, or by a newer trainer: unknown
    sampler fields are ignored)."""
    unreadable = []
    for name, field in _STATUS_FIELDS.items():
        if name in status:
            try:
                json_format.ParseDict({field: status[name]}, reply)
            except json_format.ParseError:
                unreadable.append(name)
    samplers = status.get("samplers", [])
    for k, entry in enumerate(samplers if isinstance(samplers, list) else []):
        try:
            if not isinstance(entry, dict):
                raise json_format.ParseError("not an object")
            reply.samplers.append(json_format.ParseDict(entry, prompts_pb2.SamplerStatus(),
                                                        ignore_unknown_fields=True))
        except json_format.ParseError:
            unreadable.append(f"samplers[{k}]")
    if not isinstance(samplers, list):
        unreadable.append("samplers")
    if unreadable:
        log.warning("%s: %s unreadable, left out of GetStatus; the trainer writes the record again at its next step",
                    key, ", ".join(unreadable)[:300])


def status_of(step: int, total_steps: int, latest_version: int | None, samplers: list[dict]) -> dict:
    """The trainer's status record, as GetStatus reads it."""
    return {"step": step, "total_steps": total_steps, "latest_version": -1 if latest_version is None else
            latest_version, "samplers": samplers, "updated_unix": time.time()}


class StatusWriter:
    """The trainer's side of GetStatus: rewrites its status record in Redis every `every_s` (best effort: a Redis
    outage only makes the status stale, which `trainer_updated_unix` shows)."""

    def __init__(self, queue: PromptQueue, publisher, total_steps: int, every_s: float = 1.0):
        self.queue, self.publisher, self.total_steps, self.every_s = queue, publisher, total_steps, every_s
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="status", daemon=True)

    def start(self) -> "StatusWriter":
        self._thread.start()
        return self

    def write(self) -> None:
        try:
            latest = self.publisher.latest_version
            self.queue.write_status(status_of(self.step, self.total_steps, latest,
                                              self.publisher.samplers.status(latest)))
        except BufferUnavailable:
            pass

    def _loop(self) -> None:
        # the thread outlives any one failure: a status that stops for the rest of the run after one bad reply
        # looks like a hung trainer to `grpo-stream status`; each new kind of failure is logged once
        seen: set[str] = set()
        while not self._stop.wait(self.every_s):
            try:
                self.write()
            except Exception as exc:  # noqa: BLE001
                if type(exc).__name__ not in seen:
                    seen.add(type(exc).__name__)
                    log.warning("status record not written (%s: %s); trying again every %.0fs", type(exc).__name__,
                                exc, self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.write()
