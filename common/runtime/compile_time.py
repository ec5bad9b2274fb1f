"""The wall seconds a thread spends making JAX programs (tracing, lowering to MLIR, compiling or loading them from
the persistent cache), from JAX's monitoring spans: a sampler's engine thread compiles a program the first time it
meets a shape (a slot count, a window, a prompt bucket), and that time counts as generating in its summary although
it decodes nothing. A jit traced inside another's trace is a span inside the outer one, so the spans' union is what
is counted."""

from __future__ import annotations

import threading
# JAX's spans of making a program: tracing it, lowering it to MLIR, compiling it (or loading it from the persistent
# cache). A jit traced inside another's trace is a span inside the outer one, so the spans' union is counted.
COMPILE_SPAN_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                                 "/jax/core/compile/jaxpr_to_mlir_module_duration",
                                 "/jax/core/compile/backend_compile_duration"})
_watched: dict[int, "CompileSpans"] = {}
_watch_lock = threading.Lock()
_listening = False


class CompileSpans:
    """The wall seconds one thread spent making programs while watched (watch_compiles): the time a sampler's
    engine thread had work but compiled instead of decoding, which its tokens/s while generating leaves out
    (the engine alone is timed after an untimed run that compiles; gpu-check sets the two against each other)."""

    def __init__(self, thread: int):
        self.thread, self._spans = thread, []

    def _add(self, start: float, end: float) -> None:
        self._spans.append((start, end))

    def seconds(self) -> float:
        """The union of the spans so far, in seconds."""
        total, reach = 0.0, float("-inf")
        for start, end in sorted(list(self._spans)):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total

    def close(self) -> None:
        with _watch_lock:
            if _watched.get(self.thread) is self:
                del _watched[self.thread]


def _on_span(event: str, start: float, end: float, **_kwargs) -> None:
    if event in COMPILE_SPAN_EVENTS:
        spans = _watched.get(threading.get_ident())
        if spans is not None:
            spans._add(start, end)


def watch_compiles() -> CompileSpans:
    """Collect the calling thread's spans of making programs from now until the result's close()."""
    global _listening
    import jax  # noqa: PLC0415 - deferred: entry points parse the config before JAX loads

    with _watch_lock:
        if not _listening:  # one listener per process, whatever the number of threads watched
            jax.monitoring.register_event_time_span_listener(_on_span)
            _listening = True
        spans = _watched[threading.get_ident()] = CompileSpans(threading.get_ident())
    return spans
