"""The data plane's receive buffers: aligned for zero-copy placement on CPU, and never refilled while in use."""

import gc
import weakref

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpo_stream.common.weights.receive_buffers import ALIGN, ROUNDS_KEPT, ReceiveBuffers


def _sharding():
    return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)), PartitionSpec())


def test_buffers_are_aligned_contiguous_and_of_the_asked_shape():
    pool = ReceiveBuffers()
    for shape, dtype in (((3, 5), np.float32), ((7,), "bfloat16"), ((2, 3, 4), np.int8)):
        buf = pool.take(("t", shape), shape, dtype)
        assert buf.shape == shape and buf.dtype == np.dtype(dtype) and buf.flags.c_contiguous
        assert buf.ctypes.data % ALIGN == 0


def test_a_free_buffer_is_reused_and_one_in_use_never_is():
    pool = ReceiveBuffers(keep=2)
    first = pool.take("k", (64, 16), np.float32)
    first[...] = 1.0
    placed = jax.make_array_from_callback(first.shape, _sharding(), lambda idx: first[idx])
    placed.block_until_ready()
    del first
    gc.collect()
    # the placed array (on CPU it may be the buffer itself) keeps its buffer busy
    second = pool.take("k", (64, 16), np.float32)
    second[...] = 2.0
    assert pool.allocated == 2
    np.testing.assert_array_equal(np.asarray(placed), 1.0)
    del second
    gc.collect()
    third = pool.take("k", (64, 16), np.float32)  # the second one is free again: reused, not a new one
    assert pool.allocated == 2
    third[...] = 3.0
    np.testing.assert_array_equal(np.asarray(placed), 1.0)
    del third, placed
    gc.collect()
    pool.take("k", (64, 16), np.float32)
    assert pool.allocated == 2


def test_on_cpu_placing_an_aligned_buffer_does_not_copy_it():
    pool = ReceiveBuffers()
    buf = pool.take("k", (256, 64), np.float32)
    buf[...] = np.arange(buf.size, dtype=np.float32).reshape(buf.shape)
    placed = jax.make_array_from_callback(buf.shape, _sharding(), lambda idx: buf[idx])
    if jax.devices()[0].platform == "cpu":
        assert np.shares_memory(np.asarray(placed), buf)


def test_when_every_buffer_stays_busy_the_pool_keeps_at_most_keep():
    pool = ReceiveBuffers(keep=2)
    held = [pool.take("k", (8,), np.float32) for _ in range(5)]  # e.g. an engine holding on to old versions
    assert pool.allocated == 5 and len({b.ctypes.data for b in held}) == 5
    assert len(pool._arenas[("k", (8,), np.dtype(np.float32).str)]) == 2


def test_buffers_of_a_slot_no_longer_asked_for_are_let_go():
    """The pool kept every (key, shape, dtype) it was ever asked for: after a change of shapes or keys (a manifest
    with other tensors, a trainer that became multi-host) the old buffers stayed allocated for good, up to `keep`
    copies of the model per change. Now a slot not taken for ROUNDS_KEPT versions is let go."""
    pool = ReceiveBuffers(keep=2)
    old = pool.take(("t", "box"), (64, 16), np.float32)
    old_arena = weakref.ref(old.base)
    installed = old
    del old
    for rows in range(65, 65 + ROUNDS_KEPT + 1):  # each version has the same key and another shape
        installed = pool.take(("t", "box"), (rows, 16), np.float32)
        gc.collect()
    assert old_arena() is None, "the buffer of a shape no longer asked for is still held"
    assert installed.shape == (64 + ROUNDS_KEPT + 1, 16)


def test_buffers_of_slots_still_asked_for_each_version_are_reused_not_dropped():
    pool = ReceiveBuffers(keep=2)
    installed = None
    for _ in range(6):  # versions of two tensors; the engine holds the installed one
        installed = {t: pool.take((t, "box"), (8, 8), np.float32) for t in range(2)}
        gc.collect()
    assert pool.allocated == 4 and installed[0].shape == (8, 8)


def test_a_buffer_jax_let_go_is_reused_without_waiting_for_a_garbage_collection():
    """JAX drops its reference to a host buffer it placed from on its own threads through a queue emptied at the
    next garbage collection: the buffers of a version already replaced still looked busy, and every version in a
    row made a new set (four model copies alive instead of two). The pool now runs that collection itself, once per
    version, before it makes a buffer."""
    pool = ReceiveBuffers(keep=2)
    enabled = gc.isenabled()
    gc.disable()  # no collection but the pool's own
    try:
        installed = None
        for version in range(6):  # the sampler holds the installed version only
            buf = pool.take("k", (64, 16), np.float32)
            buf[...] = version
            installed = jax.make_array_from_callback(buf.shape, _sharding(), lambda idx, buf=buf: buf[idx])
            installed.block_until_ready()
            del buf
        assert pool.allocated == 2, f"{pool.allocated} buffers made for 6 versions, of which one is held at a time"
        np.testing.assert_array_equal(np.asarray(installed), 5.0)
    finally:
        if enabled:
            gc.enable()
