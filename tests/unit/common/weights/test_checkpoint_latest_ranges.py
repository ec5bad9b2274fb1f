"""The `checkpoint` transport's LATEST with fields of the right JSON kind but values no manifest can hold: a version
past int64 or below 0, a publication time past a double, text that is not UTF-8 (a lone surrogate). Each is a
failure the sampler retries, naming the field, never a ValueError, OverflowError or UnicodeEncodeError from the
manifest's build that stops the sampler."""

import json

import jax.numpy as jnp
import pytest

from grpo_stream.common.weights.checkpoint_store import CheckpointError, CheckpointWeightStore
from grpo_stream.common.weights.checkpoint_transport import CheckpointFetcher
from grpo_stream.sampler_service.weight_sync import retryable

WEIGHTS = {"w": jnp.ones((2, 2))}
RECORD = {"version": 5, "final": False, "epoch": "e1", "published_unix": 0, "location": "x",
          "tensors": [["w", [2, 2], "float32"]]}


@pytest.mark.parametrize("field, value, named", [
    ("version", 2 ** 63, "version: 9223372036854775808 is not"),
    ("version", -7, "version: -7 is not"),
    ("published_unix", 10 ** 400, "published_unix: 1000000000"),
    ("epoch", "\ud800", "epoch: not UTF-8 text"),
    ("location", "\udc00x", "location: not UTF-8 text"),
    ("tensors", [["\ud800", [2, 2], "float32"]], "tensors[0]: name not UTF-8 text"),
], ids=["version-past-int64", "version-negative", "time-past-double", "epoch-surrogate", "location-surrogate",
        "name-surrogate"])
def test_a_latest_with_values_no_manifest_holds_is_retried_naming_the_field(tmp_path, field, value, named):
    store = CheckpointWeightStore(str(tmp_path), keep=3)
    samplers = CheckpointFetcher(store)
    store.save(4, WEIGHTS, False, "e1")
    (tmp_path / "LATEST").write_text(json.dumps({**RECORD, field: value}))
    with pytest.raises(CheckpointError) as err:
        samplers.latest(4)
    assert named in str(err.value) and retryable(err.value)
    store.save(5, WEIGHTS, False, "e1")  # the trainer's next publication rewrites it
    assert samplers.latest(4).version == 5
