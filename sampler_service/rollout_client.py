"""Streaming rollout groups to the ingest, with a bounded backlog and retries.

The generation loop `put`s finished groups; a background thread sends them
in order over one bidirectional `StreamBatches` call, one batch (what the
backlog holds, up to max_groups_per_message and BATCH_BYTES; a group larger
than that alone is dropped with an error) in flight at a time, and keeps
each group until the ingest acknowledges it:
  OK                  -> done
  RESOURCE_EXHAUSTED  -> buffer full: wait retry_after_ms, send it again
  INVALID_ARGUMENT    -> the group can never be accepted: logged and counted
A stream that fails in a way a later one may not (UNAVAILABLE, a reset, no reply
within `ack_timeout_s`, a reply that does not match) is reconnected with
exponential back-off and the groups in hand are sent again. A failure no retry
fixes (the ingest refuses this sampler's token or ids, a call it does not
implement) stops the sender with a PermanentError; so does, as a
SenderStopped, anything else that ends the sender thread. Either is raised by
the next `put` or `check`, so the sampler stops instead of generating into a
backlog nobody sends.
`put` blocks while the backlog is full, which pauses generation instead of
dropping work. Groups whose weight version fell below `min_version` (set by the
sampler to the newest version it installed minus trainer.max_staleness) are
discarded before sending and counted as `dropped_stale`: the trainer would
drop them, and sending them first would delay the fresh groups behind them.
Groups made with another trainer epoch's weights than `epoch` (set by the
sampler when it fetches a restarted trainer's first version) are discarded too,
counted as `dropped_epoch`: their version numbers are the old trainer's, which
the new one, resumed from an earlier checkpoint, would read as its own (or as
versions from its future). Neither applies to the answer to an injected
`train: false` prompt: it is evaluated, never trained, so its weights' age does
not matter, and dropping it left the prompt to wait out its claim lease and be
generated again (up to prompts.max_claims times, then cancelled).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import typing

import grpc

from grpo_stream.common.config.access import BATCH_BYTES
from grpo_stream.common.runtime.backoff import Backoff
from grpo_stream.common.runtime.errors import PermanentError, TransientError, is_transient
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

_OK, _INVALID, _EXHAUSTED = 0, grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
# How long the sender waits for the ingest to acknowledge one batch before it gives the stream up and reconnects.
# The ingest answers every batch at once (a full buffer is an immediate RESOURCE_EXHAUSTED ack, Redis calls have
# their own timeouts), so a minute of silence is a stream that hangs (a half-open connection, a peer that froze).
ACK_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0  # close() waits this long for the sender thread (a daemon: it cannot hold up the exit)
# BATCH_BYTES: the most bytes of groups one RolloutBatch carries. Batches were capped by count alone, and 16 long
# groups (16 completions of 32k tokens: 4 MiB each) made a message over the limit, which gRPC fails as
# RESOURCE_EXHAUSTED (transient): the same batch was sent again for ever.


class _Queued(typing.NamedTuple):
    epoch: str  # the trainer epoch whose weights made it ("": unknown)
    group: rollout_pb2.RolloutGroup
    evaluation_only: bool  # an injected train=false prompt's answer: sent whatever its weights' age
    started_at: int  # the weight version installed when the group started (what `lost` is told)


class _BadReply(TransientError):
    """The ingest's answer does not match what was sent: reconnect and send again."""


class _NoAck(TransientError):
    """No acknowledgement within the ack deadline: reconnect and send again."""


class IngestRefused(PermanentError, PermissionError):
    """The ingest refuses this sender for good (its token, its sampler ids): retrying cannot help. A PermissionError
    too, as before errors were classified."""


class SenderStopped(RuntimeError):
    """The sender thread ended on an error that is neither a refusal nor retried (a bug): the sampler stops."""


class RolloutClient:
    def __init__(self, channel: grpc.Channel, backlog_max_groups: int, max_groups_per_message: int = 16,
                 ack_timeout_s: float = ACK_TIMEOUT_S, max_batch_bytes: int = BATCH_BYTES):
        """`max_batch_bytes`: the most bytes of groups in one message (below the channel's message limit)."""
        self._max_per_message, self._max_batch_bytes = max_groups_per_message, max_batch_bytes
        self._ack_timeout_s = ack_timeout_s
        self._stub = rollout_pb2_grpc.RolloutIngestStub(channel)
        # (trainer epoch of the weights that made it, group)
        self._backlog: queue.Queue[tuple[str, rollout_pb2.RolloutGroup]] = queue.Queue(maxsize=backlog_max_groups)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-sender", daemon=True)
        self.stats = collections.Counter()
        self._unacked = 0
        self._lock = threading.Lock()
        self.min_version = 0
        self.epoch = ""  # the trainer epoch whose groups are sent ("": any)
        self.refused: str | None = None  # why the ingest refuses this sender for good (its token or its ids)
        # told the starting version of each training group that never reaches the trainer though it was queued (the
        # ingest refused it as invalid, or it is over a message's size): sampler.max_groups_per_version must not count
        # it, or a synchronous sampler waits for a version the trainer, short of that group, never makes
        self.lost: typing.Callable[[int], None] | None = None
        self.error: BaseException | None = None  # what ended the sender thread (None while it runs or after close)
        self._in_hand: list[_Queued] = []  # taken from the backlog, not yet acknowledged
        self._next: _Queued | None = None  # taken from the backlog, left for the next batch (BATCH_BYTES)
        self._call = None  # the StreamBatches call in use (close() cancels it)
        self._awaiting: tuple[float, object] | None = None  # (since when, call) while an ack is awaited
        self._expired = None  # the call the ack watch cancelled
        self._watch = threading.Thread(target=self._watch_acks, name="rollout-ack-watch", daemon=True)

    def start(self) -> "RolloutClient":
        self._thread.start()
        self._watch.start()
        return self

    def check(self) -> None:
        """Raise what stopped the sender thread, if it stopped on an error: IngestRefused (or another
        PermanentError) as it is, anything else as SenderStopped."""
        exc = self.error
        if exc is None:
            return
        if isinstance(exc, PermanentError):
            raise exc
        raise SenderStopped(f"the rollout sender thread stopped: {type(exc).__name__}: {exc}") from exc

    def put(self, group: rollout_pb2.RolloutGroup, timeout_s: float, epoch: str = "",
            evaluation_only: bool = False, started_at: int = -1) -> bool:
        """Queue a group made with trainer `epoch`'s weights ("": unknown, never discarded for it), waiting up to
        timeout_s while the backlog is full; False (not queued) on timeout. `evaluation_only` (an injected train=false
        prompt's answer): never discarded for its weights' age or epoch. `started_at`: the weight version installed
        when it started (told to `lost`).
        Raises what stopped the sender (`check`): IngestRefused once the ingest has refused this sender's token or
        sampler ids, SenderStopped after the thread died of anything else."""
        self.check()
        # counted before it is queued: the sender may take it, and settle or drop it (subtracting), before put returns;
        # counted after, `unacked` read -1 meanwhile and the ingest refused the Admit that reported it
        with self._lock:
            self._unacked += 1
        try:
            self._backlog.put(_Queued(epoch, group, evaluation_only, started_at), timeout=timeout_s)
        except queue.Full:
            with self._lock:
                self._unacked -= 1
            return False
        return True

    @property
    def unacked(self) -> int:
        with self._lock:
            return self._unacked

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued group is acknowledged; True if it happened in time."""
        deadline = time.monotonic() + timeout_s
        while self.unacked and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        return self.unacked == 0

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the sender: an ack awaited is abandoned (its call cancelled); waits up to timeout_s. The groups still
        unacknowledged then are never sent: counted as stats['unsent'] and logged (a drain that timed out said only
        that it did)."""
        first = not self._stop.is_set()
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        deadline = time.monotonic() + timeout_s
        for thread in (self._thread, self._watch):
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        left = self.unacked
        if first and left > 0:
            self.stats["unsent"] = left
            log.warning("rollout sender stopped with %d groups not acknowledged by the ingest: they are not trained "
                        "(a restarted sampler generates their data positions again)", left)

    def _take(self, pending: list) -> list:
        """Groups to send next: the ones still in hand, else what the backlog holds (waits briefly); too stale
        ones are discarded on the way."""
        if pending:
            return self._fresh(pending)
        batch, size = [], 0
        while len(batch) < self._max_per_message:
            item, self._next = self._next, None
            if item is None:
                try:
                    item = self._backlog.get_nowait() if batch else self._backlog.get(timeout=0.2)
                except queue.Empty:
                    break
            item_size = item.group.ByteSize()
            if item_size > self._max_batch_bytes:
                self._too_large(item, item_size)
            elif size + item_size > self._max_batch_bytes:
                self._next = item  # the first of the next batch
                break
            else:
                batch.append(item)
                size += item_size
        return self._fresh(batch)

    def _too_large(self, item: _Queued, size: int) -> None:
        """A group larger than a message may be: no send can ever deliver it, so it is dropped (counted), not sent
        again for ever."""
        self.stats["rejected_too_large"] += 1
        with self._lock:
            self._unacked -= 1
        self._tell_lost(item)
        log.error("group %s not sent: %.1f MiB, over the %.1f MiB a rollout message may carry (common/config/access.py "
                  "BATCH_BYTES); lower generation.max_new_tokens or generation.num_generations",
                  item.group.group_id, size / 2**20, self._max_batch_bytes / 2**20)

    def _tell_lost(self, item: _Queued) -> None:
        if self.lost is not None and not item.evaluation_only and item.started_at >= 0:
            self.lost(item.started_at)

    def _fresh(self, groups: list) -> list:
        """`groups` less those too stale to send and those of another trainer epoch than `epoch` (counted)."""
        floor, epoch = self.min_version, self.epoch
        kept, other, stale = [], 0, 0
        for item in groups:
            if item.evaluation_only:
                kept.append(item)
            elif epoch and item.epoch and item.epoch != epoch:
                other += 1
            elif item.group.policy_version < floor:
                stale += 1
            else:
                kept.append(item)
        if other:
            self.stats["dropped_epoch"] += other
            log.warning("%d groups made with another trainer epoch's weights not sent (the trainer restarted: their "
                        "version numbers are not its own)", other)
        if stale:
            self.stats["dropped_stale"] += stale
        if other or stale:
            with self._lock:
                self._unacked -= other + stale
        return kept

    def _settle(self, pending: list, acks) -> tuple[list, int]:
        """Count the acks of one batch; return (groups to send again, retry delay in ms)."""
        if len(acks) != len(pending):
            raise _BadReply(f"ingest answered {len(acks)} acks for {len(pending)} groups")
        again, retry_ms = [], 0
        for item, ack in zip(pending, acks):
            if ack.code == _OK:
                self.stats["accepted"] += 1
            elif ack.code == _INVALID:
                self.stats["rejected_invalid"] += 1
                log.error("ingest rejected group %s: %s", ack.group_id, ack.message)
                self._tell_lost(item)
            else:
                self.stats["retried"] += 1
                again.append(item)
                retry_ms = max(retry_ms, ack.retry_after_ms, 10)
        with self._lock:
            self._unacked -= len(pending) - len(again)
        return again, retry_ms

    def _run(self) -> None:
        """The sender thread: streams until close(); whatever ends it otherwise is kept for `check`."""
        try:
            self._send_until_closed()
        except BaseException as exc:  # noqa: BLE001 - handed to the generation loop, which stops the sampler
            if not isinstance(exc, PermanentError):
                log.exception("rollout sender thread failed; the sampler stops")
            self.error = exc

    def _send_until_closed(self) -> None:
        """One stream after another: a stream that fails in a way a later one may not is reconnected after a
        back-off, with the groups in hand sent again; a permanent failure is raised."""
        backoff = Backoff(0.1, 5.0)
        while not self._stop.is_set():
            try:
                self._stream(backoff)
            except (grpc.RpcError, StopIteration, TransientError) as exc:
                if self._stop.is_set():
                    return
                if isinstance(exc, grpc.RpcError) and not is_transient(exc):
                    raise self._refusal(exc) from None
                self.stats["reconnects"] += 1
                delay = backoff.next()
                log.warning("rollout stream to ingest failed (%s); retrying in %.1fs with %d groups in hand",
                            _why(exc), delay, len(self._in_hand))
                self._stop.wait(delay)

    def _stream(self, backoff: Backoff) -> None:
        """Send over one StreamBatches call until close() or until the call fails (raises); `self._in_hand` keeps
        the groups not yet acknowledged, in order, for the next call."""
        requests: queue.Queue = queue.Queue()

        def request_iter():
            while True:
                item = requests.get()
                if item is None:
                    return
                yield item

        call = self._call = self._stub.StreamBatches(request_iter())
        try:
            while not self._stop.is_set():
                self._in_hand = self._take(self._in_hand)
                if not self._in_hand:
                    continue
                requests.put(rollout_pb2.RolloutBatch(groups=[item.group for item in self._in_hand]))
                self._in_hand, retry_ms = self._settle(self._in_hand, self._await_ack(call).acks)
                backoff.reset()
                if self._in_hand:  # buffer full or unavailable: the same groups again, in order
                    self._stop.wait(retry_ms / 1000)  # (close() ends the wait)
        finally:
            requests.put(None)
            call.cancel()

    def _await_ack(self, call) -> rollout_pb2.BatchAck:
        """The next acknowledgement of `call`; _NoAck (transient) when none comes within the ack deadline (the
        ack watch cancels the call)."""
        self._awaiting = (time.monotonic(), call)
        try:
            return next(call)
        except grpc.RpcError:
            if self._expired is call:
                raise _NoAck(f"no acknowledgement within {self._ack_timeout_s:g}s (ACK_TIMEOUT_S)") from None
            raise
        finally:
            self._awaiting = None

    def _watch_acks(self) -> None:
        """The ack watch (one thread per client, not a timer per message): cancels a call whose awaited ack is
        later than the ack deadline, which ends the sender's wait with _NoAck."""
        while not self._stop.wait(min(1.0, self._ack_timeout_s / 4)):
            awaiting = self._awaiting
            if awaiting is not None and time.monotonic() - awaiting[0] > self._ack_timeout_s:
                if self._awaiting is awaiting:  # still the same wait (not an ack that came meanwhile)
                    self._expired = awaiting[1]
                    awaiting[1].cancel()

    def _refusal(self, exc: grpc.RpcError) -> PermanentError:
        """The error a non-retryable status of the stream ends the sender with (the groups in hand are lost); set
        as `error` before `refused`, so whoever sees `refused` gets the error from put()."""
        if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            why = (f"the ingest refused this sampler's groups ({exc.code().name}: {exc.details()}); check its token "
                   "(auth.token_file, $GRPO_STREAM_TOKEN_FILE) and its sampler id")
            error: PermanentError = IngestRefused(why)
        else:
            why = (f"the ingest ended the rollout stream with {exc.code().name} ({exc.details()}), an answer no retry "
                   "changes")
            error = PermanentError(why)
        log.error("%s; %d groups not sent", why, len(self._in_hand) + self._backlog.qsize() + (self._next is not None))
        self.error, self.refused = error, why
        return error


def _why(exc: BaseException) -> str:
    """What ended a stream, for the reconnect warning: an RpcError's code and details (an ingest that failed on an
    error of its own answers UNKNOWN, and the code alone did not say which), else the error's text."""
    if not isinstance(exc, grpc.RpcError):
        return str(exc) or "stream closed"
    details = exc.details() if callable(getattr(exc, "details", None)) else None
    return f"{exc.code()}: {details[:300]}" if details else str(exc.code())
