"""A final version left in weights.checkpoint_dir by an earlier trainer process does not stop a sampler of a resumed
run. docs/operations.md: raise trainer.steps to train a finished run further. With weights.transport=checkpoint the
store (RUN_DIR/weights under `up`) still holds the finished run's last version, marked final; the resumed trainer
serves its health check before it restores and publishes, so a sampler starting beside it read that old record,
installed it as final, and stopped (exit 0, which `up` does not restart), and the trainer waited for groups that no
sampler would make. A stored final version is final only when the trainer that answers published it (its epoch); a
trainer that answers nothing published yet, or another epoch, is running on. A trainer that cannot be reached leaves
the record as it is (one that ended and exited)."""

import grpc
import jax
import jax.numpy as jnp

from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.common.weights.checkpoint_store import CheckpointWeightStore
from grpo_stream.common.weights.checkpoint_transport import CheckpointFetcher, CheckpointSink
from grpo_stream.sampler_service.weight_sync import WeightSync
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer
from tests.support import FakeClock


def _sync(model, store, channel) -> WeightSync:
    mesh = make_mesh(1, 1, jax.devices()[:1], "sampler.mesh.tp")
    return WeightSync(CheckpointFetcher(store), model, mesh, "sampler-0", channel=channel, clock=FakeClock())


def test_an_earlier_trainer_s_final_version_does_not_stop_the_sampler_of_a_resumed_run(tiny_parts, tmp_path):
    _, _, _, model = tiny_parts
    named = {n: jnp.asarray(a) for n, a in model.to_named_numpy().items()}
    store = CheckpointWeightStore(str(tmp_path / "weights"))
    store.save(5, named, True, "finished")  # the finished run's last version
    resumed = WeightPublisher(CheckpointSink(store), "checkpoint", epoch="resumed")
    server = TrainerServer(None, resumed, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}", options=CHANNEL_OPTIONS)
    sync = _sync(model, store, channel)
    try:
        got = sync.poll()  # the resumed trainer restores: nothing published yet
        assert (got.version, got.epoch, got.final) == (5, "finished", False)
        sync.mark_installed(got, report=False)
        assert sync.poll() is None  # asked again: still not the end
        resumed.publish_arrays(5, named)  # it publishes its restored version, and trains on
        got = sync.poll()
        assert (got.version, got.epoch, got.final) == (5, "resumed", False)
        sync.mark_installed(got, report=False)
        resumed.publish_arrays(6, named, final=True)  # its own final version ends the sampler
        got = sync.poll()
        assert (got.version, got.epoch, got.final) == (6, "resumed", True)
    finally:
        sync.close()
        channel.close()
        server.stop(0)
    # a trainer that ended and exited: the final record stands
    gone = grpc.insecure_channel("127.0.0.1:1", options=CHANNEL_OPTIONS)
    sync = _sync(model, CheckpointWeightStore(str(tmp_path / "ended")), gone)
    sync.fetcher.store.save(3, named, True, "ended")
    try:
        got = sync.poll()
        assert (got.version, got.epoch, got.final) == (3, "ended", True)
    finally:
        sync.close()
        gone.close()
