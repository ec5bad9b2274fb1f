"""The sampler's engine on a thread of its own: one `serve` over the rollout stream, from the first weights to the
last (or a stop). Whatever ends the serve early (an engine error) is kept and raised on the feeder's thread."""

from __future__ import annotations

import threading
from typing import Any, Callable


class EngineThread:
    def __init__(self, engine, params: Any, stream, refresh: Callable, version: int, name: str):
        self.engine, self.stream = engine, stream
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, args=(params, refresh, version), name=name, daemon=True)
        self._thread.start()

    def _serve(self, params, refresh, version) -> None:
        try:
            self.engine.serve(params, self.stream, refresh, version)
        except BaseException as exc:  # noqa: BLE001 - raised by check() on the feeder's thread
            self.error = exc
            self.stream.cancel()

    def check(self) -> None:
        """Raise what ended the serve; a serve that ended without error while the stream is open is a bug."""
        if self.error is not None:
            raise self.error
        if not self._thread.is_alive() and self.stream.open():
            raise RuntimeError("the engine's serve ended while the rollout stream was open")

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
