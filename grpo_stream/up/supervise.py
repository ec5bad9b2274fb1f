"""How `up` keeps its processes running: a restart policy per process (up.restart, up.restart_limit_burst,
up.restart_limit_interval_s, up.healthy_after_s, up.restart_backoff_s, up.restart_backoff_max_s), as Kubernetes
restarts a failed pod or JobSet a failed job.

Restarting is safe because every process resumes by itself: the trainer from its newest checkpoint (and the
buffer's pending entries), a sampler from its data position (asked of the ingest), the standalone ingest holds no
state, and the embedded Redis replays its AOF. Each process has its own jittered exponential back-off.

The budget is counted in a time window and reset by healthy uptime, not over the whole run: a week-long run meets
many preemptions of each process, each healed, and must not stop at the sixth. What stops the run is a crash
loop: more than restart_limit_burst restarts of one process within restart_limit_interval_s, none of them followed
by healthy_after_s of uptime (systemd's StartLimitBurst/StartLimitIntervalSec; Kubernetes resets CrashLoopBackOff
once a container ran 10 minutes). A process that ran healthy_after_s also starts its back-off again from the
first wait.

Two exits are not restarts:
- a process that exits EXIT_PERMANENT (3) met a failure a restart cannot fix (common/runtime/errors.py): the run
  stops, naming the process and the reason it recorded in RUN_DIR/failures/NAME.json (else its log). Before every
  (re)start of a process its old record is removed, so a record always speaks for the latest attempt.
- a trainer job whose processes all run but make no progress (the newest of their heartbeats,
  common/runtime/heartbeat.py, older than up.trainer_stall_s, and never older than the job's start) is hung: it is
  killed and restarted exactly as after a trainer failure, against the same budget (`StallWatch`). A sampler whose
  heartbeat is older than up.sampler_stall_s the same. It counts as
  healthy (up.healthy_after_s) only for as long as it made progress, so a job that hangs at the same point after
  every restart stops the run like a crash loop.

A start that fails (a fork refused for memory, a restarted Redis whose port was taken meanwhile) counts as a failure
of that process, against the same budget; one whose program is missing or not executable stops the run as a
permanent failure. A pause of `up` itself (the host suspended, a scheduler's SIGSTOP of the
whole job; PAUSED_S) is no stall: the stall clocks count again from the resume. They run on the monotonic clock
(which stands still while the host is suspended), so a step of the wall clock (NTP) neither kills a process that
beats nor hides one that hangs.

`Watch` is the loop that applies all of this to the processes `up` started (grpo_stream/up/run.py); it knows them only
through the small `Unit` interface, so tests drive it with any child process.
"""

from __future__ import annotations

import collections
import pathlib
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from grpo_stream.common.config.process import UpSection
from grpo_stream.common.runtime.backoff import Backoff
from grpo_stream.common.runtime.errors import EXIT_PERMANENT, EXIT_USAGE, clear_permanent, read_permanent
from grpo_stream.common.runtime.heartbeat import beat_path

# a gap this long between two looks of the watch (it looks every poll_s, 0.2 s) means `up` itself was not running
PAUSED_S = 120.0


class Supervisor:
    """Decides, per failed process, whether and when it starts again, and counts restarts for summary.json."""

    def __init__(self, policy: UpSection, clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock = policy, clock
        self.restarts: collections.Counter = collections.Counter()  # every restart of the run, per process
        self._due: dict[str, float] = {}
        self._backoff: dict[str, Backoff] = {}
        self._counted: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # restart times
        self._since = clock()  # every process started before the supervisor was made
        self._started: dict[str, float] = {}

    def failed(self, name: str, healthy_s: float | None = None) -> float | None:
        """Process `name` failed (exit code not 0, or killed): the seconds until it restarts, or None when the run
        must stop instead (restart: never, or the burst used up within the window). Call once per failure.
        `healthy_s`: how long it ran healthy, where the caller knows better than its uptime (a stalled trainer job:
        until its last progress)."""
        if self.policy.restart == "never":
            return None
        now = self.clock()
        counted = self._counted[name]
        ran = now - self._started.get(name, self._since) if healthy_s is None else healthy_s
        if ran >= self.policy.healthy_after_s:
            counted.clear()  # it ran healthy: earlier restarts were not a loop, and the back-off starts again
            self._backoff.pop(name, None)
        while counted and now - counted[0] >= self.policy.restart_limit_interval_s:
            counted.popleft()
        if len(counted) >= self.policy.restart_limit_burst:
            return None
        backoff = self._backoff.setdefault(name, Backoff(self.policy.restart_backoff_s,
                                                         self.policy.restart_backoff_max_s))
        delay = backoff.next()
        self._due[name] = now + delay
        return delay

    def budget(self, name: str) -> str:
        """How much of `name`'s restart budget is used, for `up`'s log lines."""
        p = self.policy
        if p.restart == "never":
            return "up.restart=never"
        return (f"{len(self._counted[name])} of up.restart_limit_burst={p.restart_limit_burst} restarts within "
                f"up.restart_limit_interval_s={p.restart_limit_interval_s:g}s, none followed by "
                f"up.healthy_after_s={p.healthy_after_s:g}s of uptime")

    def waiting(self, name: str) -> bool:
        """A restart of `name` is scheduled and not yet made."""
        return name in self._due

    def due(self) -> list[str]:
        """The processes whose restart time has come (each is counted as restarted and taken off the schedule)."""
        now = self.clock()
        ready = [name for name, at in self._due.items() if at <= now]
        for name in ready:
            del self._due[name]
            self.restarts[name] += 1
            self._counted[name].append(now)
            self._started[name] = now
        return ready


class StallWatch:
    """The stall watchdog's decision (up.trainer_stall_s), on its own clock: how long the trainer job has made no
    progress. Progress is the newest beat of any of its processes (`names`), never earlier than the job's latest
    (re)start: a beat from before a restart says nothing of the new processes, and a job that has not beaten yet
    (compiling, waiting for its first rollouts) is measured from its start.

    All of it is measured on `clock` (monotonic): a beat counts when its file's mtime changed since the previous look,
    dated by its wall-clock age (`wall`) but never earlier than that look. A step of the wall clock (NTP) therefore
    moves no beat by more than one look's interval: a step forward made a fresh beat look old (a healthy process
    killed), a step back dated the last beat in the future (a hang unseen for as long as the step)."""

    def __init__(self, run_dir: pathlib.Path, names: Sequence[str], stall_s: float,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.run_dir, self.names, self.stall_s, self.clock, self.wall = run_dir, tuple(names), stall_s, clock, wall
        self._seen: dict[str, int | None] = {}  # each process's beat file mtime (ns) at the last look
        self._looked = self._progress = self.started_at = self.resumed_at = clock()
        self.restarted()

    def restarted(self) -> None:
        """The job was (re)started now: beats from before now are not its own."""
        self.started_at = self.resumed_at = self._progress = self._looked = self.clock()
        self._seen = {name: _mtime_ns(beat_path(self.run_dir, name)) for name in self.names}

    def resumed(self) -> None:
        """The whole run was paused until now (`Watch`'s PAUSED_S): the time without beats before now is not the
        job's to answer for, but its progress since its start still counts (up.healthy_after_s)."""
        self._look()
        self.resumed_at = self.clock()

    def _look(self) -> float:
        """Note the beats since the last look; returns now (on `clock`)."""
        now, wall_now = self.clock(), self.wall()
        since_look = max(0.0, now - self._looked)
        for name in self.names:
            mtime = _mtime_ns(beat_path(self.run_dir, name))
            if mtime is not None and mtime != self._seen.get(name):
                age = min(max(0.0, wall_now - mtime / 1e9), since_look)  # a stepped wall clock: within one look
                self._progress = max(self._progress, now - age)
            self._seen[name] = mtime
        self._looked = now
        return now

    def idle_s(self) -> float:
        """Seconds since the job last made progress (or started, or the run resumed from a pause)."""
        now = self._look()
        return max(0.0, now - max(self._progress, self.resumed_at))

    def progress_s(self) -> float:
        """Seconds from the job's (re)start to its last progress: how long it ran healthy before a stall."""
        return max(0.0, self.clock() - self.started_at - self.idle_s())

    def stalled(self) -> float | None:
        """The seconds without progress when they exceed up.trainer_stall_s, else None (and always None with 0)."""
        if self.stall_s <= 0:
            return None
        idle = self.idle_s()
        return idle if idle > self.stall_s else None


def _mtime_ns(path: pathlib.Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class Unit(Protocol):
    """What `Watch` supervises: one process, or a job of them restarted together (the multi-process trainer)."""

    name: str                # its key in the restart budget and summary.json's restarts; its log is logs/NAME.log
    records: tuple[str, ...]  # its processes' names in RUN_DIR/failures and RUN_DIR/heartbeats (none: not ours)
    must_run: bool           # any exit, even 0, is a failure (the embedded Redis)

    def start(self) -> None: ...
    def poll(self) -> int | None: ...   # the exit code once it ended (a job: its first failing process's)
    def alive(self) -> bool: ...        # every process of it runs
    def terminate(self) -> None: ...    # SIGTERM: stop cleanly
    def kill(self) -> None: ...         # SIGKILL and reap


@dataclass(frozen=True)
class Outcome:
    """Why the watch ended. reason: 'done' (the trainer finished), 'interrupted' (a stop signal), 'gave_up' (a
    failure past the restart budget, or up.restart=never) or 'permanent' (a process exited EXIT_PERMANENT);
    process and message say which and why."""

    reason: str
    process: str = ""
    message: str = ""


class Watch:
    """`up`'s supervision loop: restarts what fails per the policy, stops on a permanent failure or a used-up
    budget, and restarts a stalled trainer job. `log`: where its one-line decisions go."""

    def __init__(self, policy: UpSection, run_dir: pathlib.Path, trainer: Unit, others: Sequence[Unit],
                 log: Callable[[str], None] = lambda line: print(line, flush=True),
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 samplers: Sequence[Unit] = ()):
        """`samplers`: units among `others` watched for stalls with up.sampler_stall_s (the trainer's with
        up.trainer_stall_s)."""
        self.run_dir, self.trainer, self.log, self.clock = run_dir, trainer, log, clock
        self._looked_at = clock()  # monotonic: a step of the wall clock is no pause
        self.units = {unit.name: unit for unit in [trainer, *others]}
        self.supervisor = Supervisor(policy, clock)
        self.stalls = {trainer.name: (StallWatch(run_dir, trainer.records, policy.trainer_stall_s, clock, wall),
                                      "up.trainer_stall_s"),
                       **{unit.name: (StallWatch(run_dir, unit.records, policy.sampler_stall_s, clock, wall),
                                      "up.sampler_stall_s") for unit in samplers}}

    def launch(self, unit: Unit) -> Outcome | None:
        """(Re)start `unit`, its old permanent-failure records removed first. A start that fails (a fork refused for
        want of memory, a restarted Redis whose port another process took meanwhile) is a failure of `unit` like an
        exit: retried after its back-off against its budget, not an exception that ends `up` with every process
        killed unstopped. Returns the Outcome that stops the run, else None."""
        for name in unit.records:
            clear_permanent(self.run_dir, name)
        try:
            unit.start()
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:  # no program to run: no retry helps
            reason = (f"could not be started ({exc}): no restart brings back a missing file or a permission (a program "
                      "that is not there or not executable: sampler.python names the samplers' interpreter)")
            self.log(f"[up] {unit.name} {reason}; stopping the run")
            return Outcome("permanent", unit.name, reason)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # RedisConnectError is a RuntimeError
            return self._restart_or_stop(unit, f"could not be started ({exc})")
        if unit.name in self.stalls:
            self.stalls[unit.name][0].restarted()
        return None

    def run(self, interrupted: Callable[[], bool], poll_s: float = 0.2) -> Outcome:
        """Watch until the trainer finishes, the run must stop, or `interrupted()`."""
        while not interrupted():
            outcome = self.check()
            if outcome is not None:
                return outcome
            time.sleep(poll_s)
        return Outcome("interrupted")

    def check(self) -> Outcome | None:
        """One look at every unit: handle the failed and the stalled, start those whose restart is due."""
        self._notice_pause()
        waiting = self.supervisor.waiting
        if self.trainer.poll() == 0 and not waiting(self.trainer.name):
            return Outcome("done")
        for unit in self.units.values():
            code = None if waiting(unit.name) else unit.poll()
            if code is not None and (code != 0 or unit.must_run):
                outcome = self._failed(unit, code)
                if outcome is not None:
                    return outcome
        outcome = self._check_stall()
        if outcome is not None:
            return outcome
        for name in self.supervisor.due():
            outcome = self.launch(self.units[name])
            if outcome is not None:
                return outcome
        return None

    def permanent_reason(self, unit: Unit) -> str:
        """What `unit`'s processes recorded about their permanent failure, else where to read about it."""
        for name in unit.records:
            record = read_permanent(self.run_dir, name)
            if record is not None:
                return " ".join(record["message"].split()) or record.get("error", "")
        return f"see {self.run_dir / 'logs' / f'{unit.name}.log'}"

    def _failed(self, unit: Unit, code: int) -> Outcome | None:
        # our processes' codes for "a restart cannot fix this": a permanent failure, a config or usage error
        # (or any process of a job recorded one: the first of them to exit may be another, killed or failing after it)
        if unit.records and (code in (EXIT_PERMANENT, EXIT_USAGE)
                             or any(read_permanent(self.run_dir, name) for name in unit.records)):
            reason = self.permanent_reason(unit)
            self.log(f"[up] {unit.name} failed permanently (exit code {code}), so it is not restarted; stopping the "
                     f"run: {reason}")
            return Outcome("permanent", unit.name, reason)
        # healthy for as long as it made progress, where it beats: a trainer that needs a minute to load and compile
        # and then crashes the same way each time outlives up.healthy_after_s without ever having worked
        progress = self.stalls[unit.name][0].progress_s() if unit.name in self.stalls else None
        return self._restart_or_stop(unit, f"exited with code {code}", progress)

    def _restart_or_stop(self, unit: Unit, what: str, healthy_s: float | None = None) -> Outcome | None:
        delay = self.supervisor.failed(unit.name, healthy_s)
        budget = self.supervisor.budget(unit.name)
        if delay is None:
            self.log(f"[up] {unit.name} {what}; stopping the run ({budget})")
            return Outcome("gave_up", unit.name, f"{what} ({budget})")
        self.log(f"[up] {unit.name} {what}; restarting it in {delay:.1f}s ({budget})")
        return None

    def _notice_pause(self) -> None:
        """When `up` itself did not run for a while (the host suspended, a scheduler stopped the whole job with
        SIGSTOP), its processes did not either: without this, every one of them was killed as stalled on resume."""
        now = self.clock()
        gap, self._looked_at = now - self._looked_at, now
        if gap <= PAUSED_S:
            return
        for stall, _ in self.stalls.values():
            stall.resumed()
        self.log(f"[up] up itself did not run for {gap:.0f}s (the host suspended, or the run was stopped); the stall "
                 "watch counts progress from now")

    def _check_stall(self) -> Outcome | None:
        for name, (stall, setting) in self.stalls.items():
            unit = self.units[name]
            if self.supervisor.waiting(name) or not unit.alive():
                continue
            idle = stall.stalled()
            if idle is None:
                continue
            unit.kill()  # SIGKILL: a process hung in a collective (or holding the GIL) does not answer SIGTERM
            # healthy for as long as it made progress, not for its uptime: a unit that hangs at the same point after
            # each restart is a crash loop however long each hang lasts
            what = "job" if unit is self.trainer else "process"
            outcome = self._restart_or_stop(unit, f"{what} made no progress for {idle:.0f}s ({setting}="
                                            f"{stall.stall_s:g})", stall.progress_s())
            if outcome is not None:
                return outcome
        return None
