"""Run metrics: TensorBoard scalars plus a metrics.jsonl a script can read."""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np


class MetricsWriter:
    def __init__(self, run_dir: str | pathlib.Path, name: str):
        self.dir = pathlib.Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        from tensorboardX import SummaryWriter  # noqa: PLC0415 - heavy, only in processes that log

        self._tb = SummaryWriter(str(self.dir / "tb" / name), flush_secs=10)
        self._jsonl = open(self.dir / f"metrics-{name}.jsonl", "a", buffering=1)

    def scalars(self, step: int, values: dict[str, float], prefix: str = "", jsonl: bool = True) -> None:
        """TensorBoard scalars `prefix + name`; also one metrics.jsonl row unless jsonl is False."""
        clean = {f"{prefix}{k}": float(v) for k, v in values.items()}
        for key, value in clean.items():
            self._tb.add_scalar(key, value, step)
        if jsonl:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")

    def histogram(self, step: int, name: str, values) -> None:
        self._tb.add_histogram(name, np.asarray(values), step)

    def close(self) -> None:
        self._tb.close()
        self._jsonl.close()
