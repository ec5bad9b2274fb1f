"""The seconds a thread spends making JAX programs (common/runtime/compile_time.py): a sampler's summary leaves them
out of its tokens/s while generating, which gpu-check sets against the engine timed after its compiles."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp

from grpo_stream.common.runtime.compile_time import CompileSpans, watch_compiles


def fresh_program(k: int):
    """A program no earlier test compiled (its constant is new), with a jit inside it (traced within the outer)."""
    inner = jax.jit(lambda x: jnp.sin(x) * (k + 0.5))
    return jax.jit(lambda x: inner(x) + jnp.cumsum(x) * k)


def test_the_watched_threads_compiles_are_counted_and_another_threads_are_not():
    x = jnp.arange(64.0)
    spans = watch_compiles()
    try:
        began = time.monotonic()
        fresh_program(int(time.time_ns() % 1_000_000)).lower(x).compile()
        took = time.monotonic() - began
        before = spans.seconds()
        assert 0 < before <= took * 1.05  # the nested trace counted once: never more than the wall time
        other = threading.Thread(target=lambda: fresh_program(int(time.time_ns() % 1_000_000) + 1)(x))
        other.start()
        other.join()
        assert spans.seconds() == before  # another thread's compile (a colocated trainer's) is not this thread's
    finally:
        spans.close()
    fresh_program(int(time.time_ns() % 1_000_000) + 2)(x)
    assert spans.seconds() == before  # closed: no longer collected


def test_overlapping_spans_count_once():
    spans = CompileSpans(0)
    for start, end in ((1.0, 2.0), (1.5, 1.8), (1.9, 3.0), (5.0, 5.5)):
        spans._add(start, end)
    assert abs(spans.seconds() - 2.5) < 1e-9
