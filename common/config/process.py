"""The config sections of how every process runs: logging and the console, the JAX compilation cache, and how
`up` supervises the processes it starts."""

from __future__ import annotations

import os
import pathlib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo_stream.common.config.base import Strict

COMPILATION_CACHE_ENV = "GRPO_STREAM_COMPILATION_CACHE_DIR"  # the cache directory when the config sets none


class UpSection(Strict):
    """How `grpo-stream up` keeps its processes running: a restart budget per time window, reset by healthy uptime
    (systemd's StartLimitIntervalSec/StartLimitBurst; Kubernetes' CrashLoopBackOff), so a week-long run survives
    any number of preemptions spread over time while a crash loop still stops the run. A process that exits 3 (a
    permanent failure) is never restarted: the run stops, naming it; a trainer job that makes no progress for
    up.trainer_stall_s is restarted like a failed one (docs/supervision.md)."""

    restart: Literal["on-failure", "never"] = Field(
        "on-failure", description="'on-failure': a sampler, the standalone ingest, the trainer or the embedded Redis "
        "that exits with an error or is killed is started again (the trainer resumes from its newest checkpoint, "
        "Redis from its AOF, a sampler from its data position) and the run goes on; 'never': the first failure "
        "stops the run. Ctrl-C (SIGINT), SIGTERM and SIGHUP always stop everything.")
    restart_limit_burst: int = Field(5, ge=0, le=10_000, description="Restarts of one process allowed within "
                                     "up.restart_limit_interval_s; a failure past them stops the run (a crash loop is "
                                     "a bug to read in RUN_DIR/logs, not to retry for ever). Only restarts since the "
                                     "process last stayed up for up.healthy_after_s count.")
    restart_limit_interval_s: float = Field(300.0, gt=0, le=7 * 86_400, description="The window, in seconds, over "
                                            "which up.restart_limit_burst counts a process's restarts.")
    healthy_after_s: float = Field(30.0, gt=0, le=86_400, description="A process that has run this long since its "
                                   "(re)start is healthy: its earlier restarts stop counting against "
                                   "up.restart_limit_burst and its back-off starts again at up.restart_backoff_s. "
                                   "For the trainer and the samplers, which beat (RUN_DIR/heartbeats), 'run' is the "
                                   "time from the (re)start to the last beat: one that loads for a minute, then "
                                   "crashes the same way each time, is a crash loop.")
    stop_grace_s: float = Field(120.0, ge=5, le=86_400, description="After a stop (Ctrl-C, SIGTERM, SIGHUP, or the "
                                "run's end), how long `up` waits for the trainer to finish its step and its last "
                                "checkpoint before it kills it. Raise it for a model whose checkpoint takes "
                                "longer (and a pod's terminationGracePeriodSeconds above it).")
    restart_backoff_s: float = Field(1.0, gt=0, le=600, description="First wait before a restart; it doubles per "
                                     "restart of the same process (jittered) up to up.restart_backoff_max_s, and "
                                     "starts again from here once the process was healthy.")
    restart_backoff_max_s: float = Field(30.0, gt=0, le=3600, description="The longest wait before a restart.")
    trainer_stall_s: float = Field(1800.0, ge=0, le=7 * 86_400, description="The stall watchdog: when every process "
                                   "of the trainer job is running but none has made progress (its heartbeat, "
                                   "RUN_DIR/heartbeats/trainer-<k>, touched at every step and every 10 s while "
                                   "process 0 waits for rollouts) for this many seconds, "
                                   "counted from the job's (re)start until its first beat, `up` kills the job and "
                                   "restarts it as after a trainer failure (it counts against "
                                   "up.restart_limit_burst): a collective waiting for a process that never joins, a "
                                   "deadlock. Leave room for compilation and the first rollouts; 0 turns it off.")
    sampler_stall_s: float = Field(1800.0, ge=0, le=7 * 86_400, description="The samplers' stall watchdog: a "
                                   "sampler whose heartbeat (RUN_DIR/heartbeats/sampler-<i>, touched while its engine "
                                   "makes progress or has nothing to do) is older than this, counted from its "
                                   "(re)start until its first beat, is killed and restarted as after a failure (it "
                                   "counts against up.restart_limit_burst); what it held goes back (its admission "
                                   "grants and claimed prompts at their leases, its data position from the ingest). "
                                   "0: off.")

    @model_validator(mode="before")
    @classmethod
    def _replaced(cls, data):
        if isinstance(data, dict) and "max_restarts" in data:
            raise ValueError("up.max_restarts (a count over the whole run, which a long run with preemptions "
                             "exhausts) was replaced by a budget per time window: set up.restart_limit_burst (restarts "
                             "of one process) and up.restart_limit_interval_s (within how many seconds) instead")
        return data

    @model_validator(mode="after")
    def _backoff_cap(self) -> "UpSection":
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(f"up.restart_backoff_max_s={self.restart_backoff_max_s} < up.restart_backoff_s="
                             f"{self.restart_backoff_s}: the cap must be at least the first wait; raise it")
        return self


class LoggingSection(Strict):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level of every process.")
    format: Literal["text", "json"] = Field("text", description="'text': one readable line per record; 'json': one "
                                            "JSON object per line (time, process, level, logger, message, exc) for "
                                            "log collectors.")
    verbose: bool = Field(False, description="Detail lines at the log level: every trainer step, every weight "
                          "version a sampler fetches and installs, every checkpoint and stale drop (`up -v`). Off: "
                          "a trainer step line every logging.step_every steps and a one-line summary per sampler "
                          "every logging.summary_every_s seconds.")
    step_every: int = Field(10, ge=1, description="Without logging.verbose, the trainer prints a step line every this "
                            "many steps (and the first and last step, and after logging.summary_every_s without one).")
    summary_every_s: float = Field(30.0, gt=0, description="Without logging.verbose, each sampler prints a summary "
                                   "line (weight version, lag, groups/s, tokens/s) this often, and the trainer a step "
                                   "line at least this often.")
    file_max_mb: float = Field(256.0, ge=1, le=1 << 20, description="`up` rotates each RUN_DIR/logs/NAME.log once "
                               "it holds this many MiB: NAME.log becomes NAME.log.1, NAME.log.1 NAME.log.2 and so "
                               "on, so a week-long run (or a child printing without end) cannot fill the disk. An "
                               "earlier `up`'s log on the same run directory is rotated the same way at start.")
    file_keep: int = Field(4, ge=0, le=1000, description="Rotated logs kept per process (NAME.log.1 .. NAME.log.N, "
                           "the oldest dropped); 0 keeps only the current one. At most (1 + this) x "
                           "logging.file_max_mb per process.")


def default_compilation_cache_dir() -> str:
    """The cache directory a config that does not set one gets: ${COMPILATION_CACHE_ENV} when set (tests and
    deployments point every process at one directory), else grpo-stream/jax-compile under the user's cache directory
    ($XDG_CACHE_HOME, or ~/.cache; the XDG spec ignores a relative $XDG_CACHE_HOME)."""
    if os.environ.get(COMPILATION_CACHE_ENV):
        return os.environ[COMPILATION_CACHE_ENV]
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = pathlib.Path(xdg) if os.path.isabs(xdg) else pathlib.Path.home() / ".cache"
    return str(base / "grpo-stream" / "jax-compile")


class RuntimeSection(Strict):
    compilation_cache_dir: str | None = Field(
        default_factory=default_compilation_cache_dir, validate_default=True,
        description="JAX's persistent compilation cache: every process that compiles (trainer, samplers, colocated, "
        "eval) reads compiled programs from this directory and writes the ones it compiles, so a restarted process "
        "skips most of its compilation. Precedence: this field, else $" + COMPILATION_CACHE_ENV + ", else "
        "~/.cache/grpo-stream/jax-compile ($XDG_CACHE_HOME honoured). 'none' or null: no persistent cache. An "
        "absolute path (~ expands); a directory that cannot be created or written stops the process, except the "
        "built-in default, which only logs a warning. Anyone who can write here can make the processes run code: "
        "keep it private to the user running them.")

    @field_validator("compilation_cache_dir")
    @classmethod
    def _cache_dir(cls, value: str | None) -> str | None:
        if value is None or value.strip().lower() == "none":
            return None
        path = os.path.expanduser(value.strip())
        if not os.path.isabs(path):
            # processes of one run start in different working directories (hosts, containers)
            raise ValueError(f"{value!r} is not an absolute path (from runtime.compilation_cache_dir, else "
                             f"${COMPILATION_CACHE_ENV}); give an absolute directory (~ expands), or none to "
                             "compile without a persistent cache")
        return os.path.normpath(path)
