"""The sampler's engine on a thread of its own: one `serve` over the rollout stream, from the first weights to the
last (or a stop). Whatever ends the serve early (an engine error) is kept and raised on the feeder's thread. The
seconds the thread spent making programs instead of decoding are counted (`compile_seconds`)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from grpo_stream.common.runtime.compile_time import watch_compiles


class EngineThread:
    def __init__(self, engine, params: Any, stream, refresh: Callable, version: int, name: str):
        self.engine, self.stream = engine, stream
        self.error: BaseException | None = None
        self._compiles = None
        self._thread = threading.Thread(target=self._serve, args=(params, refresh, version), name=name, daemon=True)
        self._thread.start()

    def _serve(self, params, refresh, version) -> None:
        self._compiles = watch_compiles()
        try:
            self.engine.serve(params, self.stream, refresh, version)
        except BaseException as exc:  # noqa: BLE001 - raised by check() on the feeder's thread
            self.error = exc
            self.stream.cancel()
        finally:
            self._compiles.close()

    @property
    def compile_seconds(self) -> float:
        """Seconds the serve spent making programs (new shapes, weights relaid out), not decoding."""
        return self._compiles.seconds() if self._compiles is not None else 0.0

    def check(self) -> None:
        """Raise what ended the serve; a serve that ended without error while the stream is open is a bug."""
        if self.error is not None:
            raise self.error
        if not self._thread.is_alive() and self.stream.open():
            raise RuntimeError("the engine's serve ended while the rollout stream was open")

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
