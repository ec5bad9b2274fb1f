"""The sampler's weight checks retry only what a later poll may not meet (issue 42): a trainer away, a deadline, a
version replaced while it was fetched are retried after a back-off; a version of another model, a refused token, a
bug are raised at the first attempt, so a sampler started with the wrong model stops instead of warning for ever."""

import threading
import time

import grpc
import jax
import numpy as np
import pytest

from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.runtime.errors import PermanentError, TransientError
from grpo_stream.common.weights.snapshot import WeightTransferError, manifest_of
from grpo_stream.common.weights.transport import WeightsMismatch
from grpo_stream.sampler_service.weight_sync import WeightSync, retryable
from grpo_stream.sampler_service.weights_in_use import WeightsInUse
from tests.support import FakeClock


class RpcError(grpc.RpcError):
    """What a gRPC call raises, with a status."""

    def __init__(self, code: grpc.StatusCode, details: str = ""):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Fetcher:
    """Publishes `named` as version 0; each fetch raises the next of `errors` (then succeeds)."""

    def __init__(self, named: dict[str, np.ndarray], errors=()):
        self.named, self.errors, self.fetches = named, list(errors), 0
        self.manifest = manifest_of(0, {n: (a.shape, a.dtype) for n, a in named.items()}, False, "e1", 0.0, 0, "fake")

    def latest(self, installed_version):
        return self.manifest

    def fetch(self, manifest, targets):
        self.fetches += 1
        if self.errors:
            raise self.errors.pop(0)
        return {n: jax.device_put(self.named[n].astype(t.dtype), t.sharding) for n, t in targets.items()}


def sync_for(model, fetcher, **kw) -> WeightSync:
    mesh = make_mesh(1, 1, jax.devices()[:1], "sampler.mesh.tp")
    return WeightSync(fetcher, model, mesh, "sampler-0", retry_initial_s=1.0, retry_max_s=4.0, **kw)


TRANSIENT = [RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"),
             RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
             RpcError(grpc.StatusCode.NOT_FOUND, "version 0 is not held; ask for the manifest again"),
             WeightTransferError("w: CRC mismatch in slice 0"), TransientError("LATEST rewritten"),
             ConnectionResetError("reset by peer"), TimeoutError("fetch lane")]
PERMANENT = [RpcError(grpc.StatusCode.PERMISSION_DENIED, "sampler_id: not this token's"),
             RpcError(grpc.StatusCode.FAILED_PRECONDITION, "the trainer does not serve version bytes"),
             PermanentError("wrong model"), ValueError("parameter x: got float32[3], model wants float32[4]"),
             KeyError("layers.0")]


@pytest.mark.parametrize("error", TRANSIENT, ids=lambda e: type(e).__name__ + ":" + str(e)[:20])
def test_a_transient_failure_is_retried_after_a_back_off(tiny_parts, error):
    _, _, _, model = tiny_parts
    clock = FakeClock()
    fetcher = Fetcher(model.to_named_numpy(), [error])
    sync = sync_for(model, fetcher, clock=clock)
    assert retryable(error)
    assert sync.poll() is None and sync.failures == 1 and fetcher.fetches == 1  # kept, not raised
    assert sync.poll() is None and fetcher.fetches == 1  # inside the back-off: no attempt
    clock.advance(1.0)
    got = sync.poll()
    assert got is not None and got.version == 0 and sync.failures == 0 and fetcher.fetches == 2


@pytest.mark.parametrize("error", PERMANENT, ids=lambda e: type(e).__name__ + ":" + str(e)[:20])
def test_a_permanent_failure_is_raised_at_the_first_attempt(tiny_parts, error):
    _, _, _, model = tiny_parts
    fetcher = Fetcher(model.to_named_numpy(), [error])
    sync = sync_for(model, fetcher)
    assert not retryable(error)
    with pytest.raises(type(error)):
        sync.poll()
    assert sync.failures == 0 and fetcher.fetches == 1


def test_a_permanent_failure_of_a_background_fetch_is_raised_by_poll(tiny_parts):
    _, _, _, model = tiny_parts
    sync = sync_for(model, Fetcher(model.to_named_numpy(), [PermanentError("wrong model")]), background=True)
    try:
        with pytest.raises(PermanentError, match="wrong model"):
            for _ in range(100):  # QUICK_WAIT_S per poll: the fetch fails within the first
                sync.poll()
    finally:
        sync.close()


class HungFetcher(Fetcher):
    """The first fetch blocks until `release` is set (a shared disk that stopped answering); later ones succeed."""

    def __init__(self, named):
        super().__init__(named)
        self.release = threading.Event()

    def fetch(self, manifest, targets):
        self.fetches += 1
        self.release.wait(60)
        return {n: jax.device_put(self.named[n].astype(t.dtype), t.sharding) for n, t in targets.items()}


def test_a_background_fetch_past_its_deadline_counts_as_a_failure_once_and_is_still_waited_for(tiny_parts):
    """The checkpoint transport's restore has no deadline of its own: a hung read must not leave the sampler on its
    version for ever with no failure counted anywhere. A slow one is not a hung one: no second attempt starts beside
    it (it would hold a second copy of the weights), and it is installed when it ends."""
    _, _, _, model = tiny_parts
    clock, fetcher = FakeClock(), HungFetcher(model.to_named_numpy())
    sync = sync_for(model, fetcher, clock=clock, background=True, overdue_after_s=70.0)
    try:
        assert sync.poll() is None and fetcher.fetches == 1  # slow, or hung
        clock.advance(60.0)
        assert sync.poll() is None and sync.failures == 0  # within its deadline
        clock.advance(11.0)
        assert sync.poll() is None and sync.failures == 1  # past it: counted, reported
        clock.advance(100.0)
        assert sync.poll() is None and sync.failures == 1 and fetcher.fetches == 1  # once; no second attempt
        fetcher.release.set()  # the storage answers
        deadline = time.monotonic() + 30
        while (got := sync.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got is not None and got.version == 0 and fetcher.fetches == 1 and sync.failures == 0
    finally:
        fetcher.release.set()
        sync.close()


def test_weights_of_another_shape_stop_the_sampler_before_any_byte_is_fetched(tiny_parts):
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    other = {n: (np.zeros((a.shape[0] * 2, *a.shape[1:]), a.dtype) if n == "final_norm.w" else a)
             for n, a in named.items()}
    fetcher = Fetcher(other)
    sync = sync_for(model, fetcher, fit_hint="start the sampler with the trainer's model.path (here: /m/small)")
    size = named["final_norm.w"].shape[0]
    with pytest.raises(WeightsMismatch) as err:
        sync.poll()
    assert str(err.value) == (
        f"weights version 0 from the trainer do not fit this sampler's model: final_norm.w is ({2 * size},) there "
        f"and ({size},) here; start the sampler with the trainer's model.path (here: /m/small)")
    assert isinstance(err.value, PermanentError) and fetcher.fetches == 0

    missing = {n: a for n, a in named.items() if n != "lm_head.w"}
    with pytest.raises(WeightsMismatch, match=r"1 of its parameters are not published \(e.g. \['lm_head.w'\]\)"):
        sync_for(model, Fetcher(missing)).poll()


class StreamRunning:
    """The one thing WeightsInUse asks of a running RolloutStream (used by drains only)."""

    def set_accepting(self, accepting: bool) -> None:
        pass


@pytest.mark.parametrize("taken_in_flight", [False, True], ids=["in-use-from-start", "taken-by-the-engine"])
def test_a_version_in_use_that_the_trainer_marks_final_ends_the_stream(tiny_parts, taken_in_flight):
    """A resumed trainer whose run was already complete republishes its last version, then marks that same version
    final: the sampler already uses it, so nothing is staged, yet the feeder must see the end and stop."""
    cfg, _, _, model = tiny_parts
    named = model.to_named_numpy()
    shapes = {n: (a.shape, a.dtype) for n, a in named.items()}
    fetcher = Fetcher(named)
    weights = WeightsInUse(cfg, "sampler-0", threading.Event())
    weights.attach(sync_for(model, fetcher), None, None)
    weights.poll()  # version 0 installed before the stream starts
    weights.stream_started(StreamRunning(), None)
    if taken_in_flight:
        fetcher.manifest = manifest_of(1, shapes, False, "e1", 0.0, 0, "fake")
        weights.poll()
        assert weights.staged.refresh()[1] == 1  # the engine takes version 1 at a scheduling point
    assert weights.version == (1 if taken_in_flight else 0) and not weights.final_reached()
    fetcher.manifest = manifest_of(weights.version, shapes, True, "e1", 0.0, 0, "fake")
    weights.poll()
    assert weights.final_reached() and weights.staged.final() is None
    assert not weights.install_final() and weights.version == (1 if taken_in_flight else 0)
