"""The end of `grpo-stream up`: its part of RUN_DIR/summary.json, its last lines and its exit code.

The trainer writes RUN_DIR/summary.json at its exit (steps, groups, weight versions, evaluations); `RunSummary` is
the one place in `up` that writes it after that, adding what only `up` knows: the whole run's wall time, each
process's restarts, the samplers' exit codes and final reports, and, when a failure stopped the run, which process
and why ("failure"). When the trainer itself failed there is no summary of this run to complete: `up` says so on
stderr and exits non-zero.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys
import time
from dataclasses import dataclass

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_PERMANENT
from grpo_stream.up.relay import say_now
from grpo_stream.up.supervise import Outcome
from grpo_stream.common.tasks.rewards import scored_by
from grpo_stream.common.runtime.files import to_json, write_atomic
from grpo_stream.trainer_service.reports.run_outputs import wasted_fraction


@dataclass(frozen=True)
class RunEnd:
    """How the processes of a run ended: the watch's outcome, the trainer's exit code, each sampler's, the restarts
    per process and the trainer's log."""

    outcome: Outcome
    trainer_code: int | None
    sampler_codes: dict[str, int | None]
    restarts: dict[str, int]
    trainer_log: pathlib.Path
    restart_pending: tuple[str, ...] = ()  # samplers that failed within their budget, their restart not yet due

    def failed_samplers(self) -> dict[str, int | None]:
        """The samplers that ended with a code other than 0, but those whose restart was pending."""
        return {name: code for name, code in self.sampler_codes.items()
                if code != 0 and name not in self.restart_pending}

    def failure(self) -> dict | None:
        """The failure that stopped the run, for summary.json: the process, what kind, why; None when none did."""
        kinds = {"permanent": "permanent failure", "gave_up": "restart budget used up"}
        if self.outcome.reason not in kinds:
            return None
        return {"process": self.outcome.process, "kind": kinds[self.outcome.reason], "message": self.outcome.message}

    def exit_code(self, summary_written: bool) -> int:
        """`up`'s exit code (grpo_stream/up/run.py's module doc)."""
        if self.outcome.reason == "interrupted":
            return EXIT_INTERRUPTED
        if self.outcome.reason == "permanent":
            return EXIT_PERMANENT
        if not summary_written or self.outcome.reason == "gave_up":
            return EXIT_FAILURE
        return EXIT_FAILURE if self.failed_samplers() else EXIT_OK


class RunSummary:
    """The owner of `up`'s part of RUN_DIR/summary.json (module doc)."""

    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, started: float):
        self.cfg, self.path, self.started = cfg, run_dir / "summary.json", started

    def finish(self, end: RunEnd) -> int:
        """Complete the summary when the trainer wrote one, print the run's last lines, return the exit code."""
        written, summary = end.trainer_code == 0 and self.path.exists(), {}
        if written:
            summary = self.complete(json.loads(self.path.read_text()), end)
            write_atomic(self.path, to_json(summary, indent=2))
            say_now(done_line(summary, self.path))
        # what failed, last and on stderr, also after a summary the trainer could still write (its stop was clean):
        # else the last line of a run stopped by a crash-looping sampler read "[up] done in ..."
        failed_samplers = end.failed_samplers()
        if end.outcome.reason == "gave_up":  # the process whose budget ran out, not the trainer up then stopped
            say_now(f"grpo-stream up: {end.outcome.process} gave up: {end.outcome.message}; see "
                    f"{self.log_of(end.outcome.process)}", sys.stderr)
        elif end.outcome.reason == "permanent":
            say_now(f"grpo-stream up: {end.outcome.process} failed permanently: {end.outcome.message}", sys.stderr)
        elif end.outcome.reason == "interrupted" and not written:  # a stop, not a trainer failure: a trainer told to
            # stop while it was starting (before its handler was in place) ends by the signal, with no summary
            say_now(f"grpo-stream up: stopped by a signal before the trainer wrote its summary (trainer exit code "
                    f"{end.trainer_code}); {self.resume_hint()}; see {end.trainer_log}", sys.stderr)
        elif end.outcome.reason == "interrupted" and summary.get("stopped_early"):  # else its last line read "done in"
            say_now(f"grpo-stream up: stopped by a signal at step {summary.get('steps')} of {self.cfg.trainer.steps}; "
                    f"{self.resume_hint()}", sys.stderr)
        elif not written:
            say_now(f"grpo-stream up: trainer exited with code {end.trainer_code}; see {end.trainer_log}", sys.stderr)
        elif end.outcome.reason == "done" and failed_samplers:
            say_now("grpo-stream up: the trainer finished, but " + ", ".join(
                f"{name} exited with code {code} (see {self.log_of(name)})" for name, code in failed_samplers.items()),
                sys.stderr)
        return end.exit_code(written)

    def resume_hint(self) -> str:
        """How to resume: `up` without --run-dir starts a new run in a new directory (runs/<run.name>-<time>)."""
        run_dir = self.path.parent
        return (f"run the same command on {run_dir} to resume (grpo-stream up --run-dir {shlex.quote(str(run_dir))} "
                "with the same --config and overrides)")

    def log_of(self, process: str) -> pathlib.Path:
        """Where `process`'s own words are: RUN_DIR/logs/NAME.log, the embedded Redis's RUN_DIR/redis/redis.log."""
        run_dir = self.path.parent
        return run_dir / "redis" / "redis.log" if process == "redis-server" else run_dir / "logs" / f"{process}.log"

    def complete(self, summary: dict, end: RunEnd) -> dict:
        """The trainer's `summary` with up's fields added."""
        summary["trainer_wall_seconds"] = summary.pop("wall_seconds")
        summary["wall_seconds"] = round(time.time() - self.started, 2)
        summary["sampler_exit_codes"] = end.sampler_codes
        summary["restarts"] = end.restarts
        if end.restart_pending:  # their exit codes are of a failure `up` was restarting them from
            summary["samplers_restart_pending"] = list(end.restart_pending)
        if end.failure() is not None:
            summary["failure"] = end.failure()
        run_dir = self.path.parent
        # this run's samplers only: a file of an earlier `up` here (more replicas then, or a sampler that did not
        # write its file this time) says nothing of this one
        files = [run_dir / f"sampler-{i}.json" for i in range(self.cfg.sampler.replicas)]
        reports = {p.stem: sampler_report(p) for p in files if p.exists() and p.stat().st_mtime >= self.started}
        summary["samplers"] = {name: doc for name, doc in reports.items() if doc is not None}
        damaged = sorted(name for name, doc in reports.items() if doc is None)
        if damaged:
            summary["samplers_damaged"] = damaged
        counted = all("groups_generated" in s for s in summary["samplers"].values())
        if summary["samplers"] and counted and not damaged:
            # the samplers' own final counts (their last reports to the trainer may miss the last batches); each
            # file is its sampler's last process's, so the trainer's count, which adds up restarted processes, is
            # the floor. A damaged file's count is unknown: the trainer's count stands then
            generated = max(sum(s["groups_generated"] for s in summary["samplers"].values()),
                            summary.get("groups_generated") or 0)
            summary["groups_generated"] = generated
            summary["generation_wasted_fraction"] = wasted_fraction(
                generated, (summary["steps"] - (summary["resumed_from"] or {}).get("step", 0))
                * self.cfg.trainer.groups_per_step)
        return summary


def sampler_report(path: pathlib.Path) -> dict | None:
    """A sampler's final report (RUN_DIR/sampler-<index>.json), or None with a warning naming it when the file holds
    no JSON object: `up` stops a sampler still running FINISH_S after the trainer finished, and one killed while
    writing its file leaves it cut short. The run ended; that one file must not cost it the rest of its summary."""
    try:
        doc = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as exc:
        why = f"not JSON ({exc})"
    else:
        if isinstance(doc, dict):
            return doc
        why = "not a JSON object"
    say_now(f"grpo-stream up: warning: {path}: {why} (cut short when the sampler was stopped?); summary.json leaves "
            "its figures out and lists it under samplers_damaged", sys.stderr)
    return None


def done_line(summary: dict, path: pathlib.Path) -> str:
    dropped = sum(summary[f"groups_dropped_{kind}"] for kind in ("stale", "invalid", "filtered", "duplicate"))
    unacknowledged = summary.get("groups_trained_unacknowledged") or 0
    trained = f"{summary['groups_trained']}" + (f" ({unacknowledged} not yet acknowledged)" if unacknowledged else "")
    ended = "stopped after" if summary.get("stopped_early") else "done in"  # a stop signal: "done" it was not
    return (f"[up] {ended} {summary['wall_seconds']:.0f}s: {summary['steps']} steps, groups ingested "
            f"{summary['groups_ingested']} = trained {trained} + dropped {dropped} + left "
            f"{summary['groups_left_in_buffer']}; held-out {_eval_change(summary)}; summary: {path}")


def _eval_change(summary: dict) -> str:
    """'greedy reward by task.rewards (answer_correct x1 + answer_format x0.1) 0.578 -> 0.835 (answer_correct 0.525
    -> 0.759, answer_format 0.530 -> 0.760); greedy accuracy 0.525 -> 0.759, sampled pass@1 0.413 -> 0.603': the
    run's own measure first (its rewards, each one's figure), then answer_correct's accuracy (and pass@1 when
    eval.samples > 0), which a run rewarding something else may not move."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}

    def fmt(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    if not after:  # stopped before the end, or eval_after off: "0.000 -> None" said nothing
        return (f"greedy accuracy {fmt(before.get('accuracy'))} before RL, none after (no eval_after)" if before
                else "not evaluated")
    weights = after.get("reward_weights", before.get("reward_weights"))
    text = ""
    if weights is not None:
        parts = ", ".join(f"{name} {fmt((before.get('reward_components') or {}).get(name))} -> "
                          f"{fmt((after.get('reward_components') or {}).get(name))}" for name in weights)
        text = (f"greedy {scored_by(weights)} {fmt(before.get('reward'))} -> {fmt(after.get('reward'))}"
                + (f" ({parts})" if parts else "") + "; ")
    text += f"greedy accuracy {fmt(before.get('accuracy'))} -> {fmt(after.get('accuracy'))}"
    if (before.get("pass_at_k") or {}).get("1") is not None:
        text += f", sampled pass@1 {fmt(before['pass_at_k']['1'])} -> {fmt((after.get('pass_at_k') or {}).get('1'))}"
    return text
