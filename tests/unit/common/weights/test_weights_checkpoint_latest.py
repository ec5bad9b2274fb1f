"""The `checkpoint` transport's LATEST as a sampler reads it: a file that is JSON but not a version's record
(damaged, or another program's file in weights.checkpoint_dir) is a failure the sampler retries, naming the field,
never a KeyError that stops it, nor a `null` taken for "nothing published yet"."""

import jax.numpy as jnp
import pytest

from grpo_stream.common.weights.checkpoint_store import CheckpointError, CheckpointWeightStore
from grpo_stream.common.weights.checkpoint_transport import CheckpointFetcher
from grpo_stream.sampler_service.weight_sync import retryable

WEIGHTS = {"w": jnp.ones((2, 2))}


@pytest.mark.parametrize("text, named", [
    ("{}", "no version"), ("null", "JSON null, not an object"), ("[5]", "JSON [5], not an object"),
    ('{"version": 5, "final": false, "epoch": "e1", "published_unix": 0, "location": "x"}', "no tensors"),
    ('{"version": "5", "final": false, "epoch": "e1", "published_unix": 0, "location": "x", "tensors": []}',
     'version: "5" is not a whole number'),
    ('{"version": 5, "final": false, "epoch": "e1", "published_unix": 0, "location": "x", "tensors": [["w", [2]]]}',
     "is not [name, shape, dtype]"),
    ('{"version": 5, "final": false, "epoch": "e1", "published_unix": 0, "location": "x", '
     '"tensors": [["w", [2, 2], "float99"]]}', "tensors[0]: unknown dtype 'float99'"),
], ids=["empty", "null", "list", "no-tensors", "version-text", "short-entry", "dtype"])
def test_a_damaged_latest_is_a_failure_the_sampler_retries_naming_the_field(tmp_path, text, named):
    store = CheckpointWeightStore(str(tmp_path), keep=3)
    samplers = CheckpointFetcher(store)
    store.save(4, WEIGHTS, False, "e1")
    (tmp_path / "LATEST").write_text(text)
    with pytest.raises(CheckpointError) as err:
        samplers.latest(4)
    assert named in str(err.value) and str(tmp_path / "LATEST") in str(err.value) and retryable(err.value)
    store.save(5, WEIGHTS, False, "e1")  # the trainer's next publication rewrites it
    assert samplers.latest(4).version == 5
