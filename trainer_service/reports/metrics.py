"""Run metrics: one tracker interface, several backends.

Every trainer process writes TensorBoard scalars (RUN_DIR/tb/<name>) and a metrics-<name>.jsonl a script can read
(`MetricsWriter`, the two as one); trainer process 0 adds the trackers the config enables (`open_trackers`:
Weights & Biases with tracking.wandb, wandb_tracker.py). Callers talk to one `Tracker`; a `FanOut` hands each
record to every backend, and each backend keeps the kinds of record it has a place for.
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from typing import Any, Iterable

import numpy as np

from grpo_stream.common.config.redact import redacted
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.files import to_json

log = logging.getLogger(__name__)


class Tracker:
    """A backend of the run's metrics. Each kind of record is a method; a backend without a place for a kind keeps
    the method inherited here, which drops it (TensorBoard holds no config or tables; the JSONL file only scalars).
    Steps are the caller's: RL steps for train/*, supervised steps for warmstart/*."""

    def scalars(self, step: int, values: dict[str, float], prefix: str = "", jsonl: bool = True) -> None:
        """Scalars `prefix + name` at `step`; `jsonl=False` keeps them out of metrics-<name>.jsonl."""

    def histogram(self, step: int, name: str, values) -> None:
        """The distribution of `values` at `step`."""

    def samplers(self, step: int, figures: dict[str, dict[str, float]]) -> None:
        """Per-sampler figures at an RL step: {sampler id: {figure: value}} (e.g. weight_lag)."""

    def config(self, resolved: dict[str, Any]) -> None:
        """The run's resolved config (RunConfig.model_dump(mode="json"))."""

    def samples_wanted(self, step: int) -> int:
        """How many sample completions this backend wants at RL `step` (0: none): the caller detokenizes only
        those."""
        return 0

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of sample completions of RL `step` (sample_rows)."""

    def summary(self, values: dict[str, Any]) -> None:
        """The run's final figures (summary.json, and the samplers' figures under sampler/<id>/...)."""

    def close(self, failed: bool = False) -> None:
        """Flush and release; `failed`: the run ended with an error (a tracker that records outcomes says so)."""


class TensorBoardTracker(Tracker):
    """TensorBoard event files, one event per record holding all its values: SummaryWriter.add_scalar writes an
    event, and hands it to the writer's thread through a bounded queue, per value, which at ~80 figures a step cost
    the trainer's report ~20 ms of one core and of contention with the step's own threads (BENCHMARKS.md, pipeline)."""

    def __init__(self, directory: pathlib.Path):
        from tensorboardX import summary  # noqa: PLC0415 - heavy, only in processes that log
        from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415
        from tensorboardX.writer import FileWriter  # noqa: PLC0415

        self._summary, self._proto = summary, Summary
        self._writer = FileWriter(str(directory), max_queue=256, flush_secs=10)

    def _write(self, step: int, tagged: Iterable[tuple[str, float]]) -> None:
        values = [v for tag, x in tagged for v in self._summary.scalar(tag, float(x)).value]
        if values:
            self._writer.add_summary(self._proto(value=values), step)

    def scalars(self, step: int, values: dict[str, float], prefix: str = "", jsonl: bool = True) -> None:
        self._write(step, ((f"{prefix}{key}", value) for key, value in values.items()))

    def histogram(self, step: int, name: str, values) -> None:
        self._writer.add_summary(self._summary.histogram(name, np.asarray(values), "auto"), step)

    def samplers(self, step: int, figures: dict[str, dict[str, float]]) -> None:
        # one TensorBoard chart per figure with a line per sampler: sampler_weight_lag/sampler-0, ...
        self._write(step, ((f"sampler_{figure}/{sampler}", value) for sampler, values in figures.items()
                           for figure, value in values.items()))

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class JsonlTracker(Tracker):
    """One JSON object per scalars() call: {"step", "time", prefix + name: value, ...}, one line each.

    A line cut short (a kill or a full disk mid-write) must not swallow the next one: a resumed trainer appending
    its first row onto the torn text would lose that row too, since readers skip the line (run_report.read_metrics).
    So each row is one unbuffered append of the whole line, and a file that does not end in a newline (left torn by
    a previous process, or by a write of this one that failed) gets one before the next row."""

    def __init__(self, path: pathlib.Path):
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - held open for the run; closed by close()
        self._torn = self._file.tell() > 0 and not _ends_with_newline(path)

    def scalars(self, step: int, values: dict[str, float], prefix: str = "", jsonl: bool = True) -> None:
        if jsonl:
            clean = {f"{prefix}{k}": float(v) for k, v in values.items()}
            # a NaN or infinite figure is written as null: bare NaN is no JSON (common/runtime/files.py)
            line = to_json({"step": step, "time": time.time(), **clean}) + "\n"
            data = (("\n" if self._torn else "") + line).encode()
            self._torn = True  # until the whole line is down
            while data:
                data = data[self._file.write(data):]
            self._torn = False

    def close(self, failed: bool = False) -> None:
        self._file.close()


def _ends_with_newline(path: pathlib.Path) -> bool:
    with open(path, "rb") as file:
        file.seek(-1, 2)
        return file.read(1) == b"\n"


class FanOut(Tracker):
    """Every record to every backend, in order. A backend listed in `optional` (W&B: a service outside the run)
    that fails to take a record is dropped with a warning rather than failing the trainer's step: the run's own
    files (TensorBoard, JSONL) keep every figure."""

    def __init__(self, backends: Iterable[Tracker], optional: Iterable[Tracker] = ()):
        self.backends = list(backends)
        self.optional = list(optional)

    def _each(self, method: str, *args) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(*args)
            except Exception:
                if not any(backend is o for o in self.optional):
                    raise
                log.exception("the %s tracker failed to take a record (%s); it is dropped for the rest of the "
                              "run, and the run's TensorBoard and JSONL files keep every figure",
                              type(backend).__name__, method)
                self.backends.remove(backend)

    def scalars(self, step: int, values: dict[str, float], prefix: str = "", jsonl: bool = True) -> None:
        self._each("scalars", step, values, prefix, jsonl)

    def histogram(self, step: int, name: str, values) -> None:
        self._each("histogram", step, name, values)

    def samplers(self, step: int, figures: dict[str, dict[str, float]]) -> None:
        self._each("samplers", step, figures)

    def config(self, resolved: dict[str, Any]) -> None:
        self._each("config", resolved)

    def samples_wanted(self, step: int) -> int:
        return max((backend.samples_wanted(step) for backend in self.backends), default=0)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._each("samples", step, rows)

    def summary(self, values: dict[str, Any]) -> None:
        self._each("summary", values)

    def close(self, failed: bool = False) -> None:
        """Close every backend, even after one fails to (the first error of a required one is raised once all were
        tried; an optional one's, W&B's, is logged: it never fails a run that ended)."""
        error = None
        for backend in self.backends:
            try:
                backend.close(failed)
            except Exception as exc:  # noqa: BLE001 - the others must still flush their files
                log.exception("closing the %s tracker failed", type(backend).__name__)
                if not any(backend is o for o in self.optional):
                    error = error or exc
        if error is not None:
            raise error


class MetricsWriter(FanOut):
    """What every trainer process writes: TensorBoard scalars in RUN_DIR/tb/<name> and RUN_DIR/metrics-<name>.jsonl,
    then the `extra` backends (optional: one that fails is dropped, see FanOut)."""

    def __init__(self, run_dir: str | pathlib.Path, name: str, extra: Iterable[Tracker] = ()):
        self.dir = pathlib.Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        extra = list(extra)
        super().__init__([TensorBoardTracker(self.dir / "tb" / name), JsonlTracker(self.dir / f"metrics-{name}.jsonl"),
                          *extra], optional=extra)


def open_trackers(cfg: RunConfig, run_dir: pathlib.Path, name: str = "trainer") -> MetricsWriter:
    """Trainer process 0's trackers: the files of MetricsWriter, and W&B when tracking.wandb.enabled (imported only
    then), given the resolved config."""
    extra: list[Tracker] = []
    if cfg.tracking.wandb.enabled:
        from grpo_stream.trainer_service.reports.wandb_tracker import WandbTracker  # noqa: PLC0415 - optional extra

        extra.append(WandbTracker(cfg, run_dir))
    trackers = MetricsWriter(run_dir, name, extra)
    trackers.config(redacted(cfg.model_dump(mode="json")))
    return trackers


def sample_rows(groups, staleness, max_rows: int, decode=None, injected: bool = False) -> list[dict[str, Any]]:
    """Up to `max_rows` completions of a step's groups (whole groups in order, the last cut at the cap): the prompt
    and completion as text (`decode(ids)`: the trainer's tokenizer; None: the token ids), reward, staleness, the
    version that made it and the sampler. Groups of injected prompts (a client's text) only with `injected`."""
    def text(ids) -> str:
        ids = [int(i) for i in np.asarray(ids)]
        return decode(ids) if decode is not None else " ".join(map(str, ids))

    rows: list[dict[str, Any]] = []
    for group, stale in zip(groups, staleness):
        if group.injected and not injected:
            continue
        prompt = text(group.prompt_token_ids)  # once per group: every completion shares it
        for completion in group.completions:
            if len(rows) == max_rows:
                return rows
            rows.append({"group_id": group.group_id, "sampler": group.sampler_id,
                         "version": int(group.policy_version), "staleness": int(stale), "prompt": prompt,
                         "completion": text(completion.token_ids), "reward": float(completion.reward),
                         "truncated": bool(completion.truncated)})
    return rows


def final_figures(summary: dict[str, Any], run_dir: pathlib.Path, since: float) -> dict[str, Any]:
    """summary.json's contents, plus each sampler's figures under sampler/<id>/<figure>: what the trainer knows
    (groups ingested, last installed version) and the numbers of RUN_DIR/sampler-<id>.json written since `since`
    (this trainer's start; an older file is a previous run's) when the sampler wrote it before the trainer ends
    (`up` adds them to summary.json later)."""
    figures = dict(summary)
    for sampler, groups in (summary.get("groups_by_sampler") or {}).items():
        figures[f"sampler/{sampler}/groups_ingested"] = groups
    for sampler, versions in (summary.get("sampler_weight_versions") or {}).items():
        if versions:
            figures[f"sampler/{sampler}/last_installed_version"] = versions[-1]
    for path in sorted(pathlib.Path(run_dir).glob("sampler-*.json")):
        try:
            if path.stat().st_mtime < since:
                continue
            report = json.loads(path.read_text())
        except (OSError, ValueError):  # being written as the sampler stops: its figures are not there yet
            continue
        for key, value in report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                figures[f"sampler/{path.stem}/{key}"] = value
    return figures
