"""Exactly-once training across crashes: which groups a checkpoint holds, when they are acknowledged, and resuming.

The groups of a step are acknowledged ("trained") in the buffer only after the checkpoint *after* the one holding
their update is on disk, so a crash, or a corrupt newest checkpoint, replays them from the buffer instead of losing
them; a restarted trainer resumes from the newest valid checkpoint and first settles the groups that checkpoint
already holds. Every step, checkpoint and trainer start is written to the buffer's audit trail. A Redis at
maxmemory refuses those records but not settling, which frees memory: a refused record first settles what is
acknowledgeable (`_book`), so the books never wait on memory only their own settle would free.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Callable, TypeVar

from grpo_stream.common.runtime.console import detail_logger
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.rollouts.buffer import RolloutBuffer
from grpo_stream.common.rollouts.redis_errors import BufferUnavailable, is_out_of_memory
from grpo_stream.common.runtime.backoff import StopRequested
from grpo_stream.trainer_service.checkpoints.errors import RunRefused
from grpo_stream.trainer_service.checkpoints.lora_base import check_settings
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.learning.collector import when_available
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class Resumed:
    step: int
    state: dict
    record: dict


def updater_state(updater: PolicyUpdater) -> dict:
    """What a checkpoint holds of the optimisation: parameters, optimizer state, and the KL reference if any. With
    LoRA the trained part only (`adapters`, `ref_adapters`): the frozen base is saved once (`save_base`)."""
    train, frozen = updater.split(updater.params)
    state = {"params": updater.params} if frozen is None else {"adapters": train}
    state["opt_state"] = updater.opt_state
    if updater.ref_params is not None:  # the KL reference is the policy RL started from, not the resumed one
        if frozen is None:
            state["ref_params"] = updater.ref_params
        else:
            state["ref_adapters"] = updater.split(updater.ref_params)[0]
    return state


def layout_settings(cfg: RunConfig) -> dict:
    """The settings that decide what a checkpoint's state holds (shapes, dtypes, which trees): kept in each record,
    so that a resume under other ones names the settings that changed (store.py: CheckpointMismatch)."""
    model, opt = cfg.model, cfg.trainer.optimizer
    settings = {"model.kind": model.kind, "model.dtype": model.dtype, "model.lora": lora_settings(cfg),
                "algo.beta": cfg.algo.beta, "trainer.optimizer.schedule": opt.schedule,
                "trainer.optimizer.state_dtype": opt.state_dtype}
    if model.kind == "tiny":
        settings.update({f"model.tiny.{k}": v for k, v in model.tiny.model_dump(mode="json").items()})
    else:
        settings["model.path"] = model.path
    return settings


def lora_settings(cfg: RunConfig) -> dict | None:
    """The model.lora settings a LoRA run's adapters hold their meaning under (saved with its frozen base)."""
    return None if cfg.model.lora is None else cfg.model.lora.model_dump()


class Durability:
    def __init__(self, cfg: RunConfig, buffer: RolloutBuffer, checkpoints: TrainerCheckpoints, epoch: str,
                 stop: threading.Event | None = None):
        """`stop`: the process's stop event; a Redis outage during a stop ends the wait (StopRequested)."""
        self.cfg, self.buffer, self.checkpoints, self.epoch = cfg, buffer, checkpoints, epoch
        self.available = functools.partial(when_available, stop=stop)
        self.unsettled: list[tuple[int, list[tuple[str, str]]]] = []  # (step, [(entry id, group id)]) not acked
        self.checkpointed: list[int] = []  # steps whose checkpoint is committed, by this process
        self.unlogged: list[int] = []  # of those, the ones whose audit record is not written yet
        self.held_outdated = False  # groups were settled since the held count was last written
        self.resumed_step = 0
        self.data_position: dict[str, int] = {}  # sampler -> highest data position trained
        self.buffer_position = "0-0"  # newest stream entry trained
        self.compacted_through = 0  # the audit trail was compacted through this step (by this process)
        self.base_saved = False  # LoRA: this run's frozen base is in the checkpoint directory (written or read)

    def held(self) -> int:
        """Groups trained but not yet acknowledged (waiting for their checkpoint to be safe)."""
        return sum(len(pairs) for _, pairs in self.unsettled)

    def trained(self, step: int, picked) -> None:
        """Record a step's groups: audit trail, held count, and the data and buffer positions they reach. Groups are
        picked in stream order, so the last one holds the buffer position."""
        self._book("auditing a step", lambda: self.buffer.log_step(self.epoch, step, [e.group_id for e, _ in picked]))
        self.unsettled.append((step, [(e.entry_id, e.group_id) for e, _ in picked]))
        self._write_held()
        for _, group in picked:
            if group.data_position is not None:
                self.data_position[group.sampler_id] = max(self.data_position.get(group.sampler_id, -1),
                                                           group.data_position)
        self.buffer_position = picked[-1][0].entry_id

    def save(self, step: int, updater: PolicyUpdater, extra: dict) -> None:
        """Start saving `step`; its groups and everything before are listed so a resume can settle them."""
        self._check_fence(step)
        unsettled = [[eid, gid, s] for s, pairs in self.unsettled if s <= step for eid, gid in pairs]
        frozen = updater.split(updater.params)[1]
        if frozen is not None and not self.base_saved:  # marked once written: adapters never go without it
            self.checkpoints.save_base(frozen, lora_settings(self.cfg))
            self.base_saved = True
        self.checkpoints.save(step, updater_state(updater), {
            "run": self.cfg.run.name, "epoch": self.epoch, "weight_version": step, "unsettled": unsettled,
            "data_position": dict(self.data_position), "buffer_position": self.buffer_position,
            "settings": layout_settings(self.cfg), **extra},
            token=step)

    def _check_fence(self, step: int) -> None:
        """A checkpoint is written outside Redis, where no script checks the fence: check it right before, so a
        trainer a newer one took the run from stops (StaleTrainer, after the buffer's on_stale) and writes none.
        While stopping with Redis down the check is skipped, as every other Redis wait is (when_available): the
        checkpoint is kept then, as before; no newer trainer can take the lease from a Redis that is down."""
        try:
            self.available(f"checking the trainer's fence before the checkpoint of step {step}",
                           self.buffer.check_fence)
        except StopRequested as exc:
            log.warning("%s; saving the checkpoint of step %d unchecked", exc, step)

    def committed(self, wait: bool = False, everything: bool = False) -> None:
        """Acknowledge groups whose update is safe on disk: those of steps up to the checkpoint *before* the newest
        committed one (so a corrupt newest checkpoint still finds its groups in the buffer), or, at the end of a
        completed run (`everything`), up to the newest."""
        self._poll_checkpoints(wait)
        while self.unlogged:
            step = self.unlogged[0]
            self._book("auditing a checkpoint", lambda: self.buffer.log_checkpoint(self.epoch, step))
            self.unlogged.pop(0)
            detail.info("checkpoint of step %d saved", step)
        if not self.checkpointed:
            return
        upto = self._acknowledgeable(everything)
        if any(s <= upto for s, _ in self.unsettled):
            self.available("acknowledging trained groups", lambda: self._settle_upto(upto))
        if self.held_outdated:
            self._write_held()
        # the trail of what is now final folds into counts; not at a run's end (the newest step record stays, and
        # a continued run compacts it at its first checkpoint)
        if self.cfg.buffer.compact_audit and not everything and upto > self.compacted_through:
            held_back = self.available("compacting the audit trail", lambda: self._compact(upto))
            self.compacted_through = upto  # once per acknowledged checkpoint (this runs every step)
            if held_back:
                log.warning("audit trail not compacted through step %d: %s (`grpo-stream audit` shows it)", upto,
                            held_back)

    # -- the books' writes, and Redis at maxmemory -----------------------------------------------------------------
    def _poll_checkpoints(self, wait: bool = False) -> None:
        """Take in the checkpoints committed since the last look; their audit records are written by committed()."""
        for step, _ in self.checkpoints.committed(wait=wait):
            self.checkpointed.append(step)
            self.unlogged.append(step)

    def _acknowledgeable(self, everything: bool = False) -> int:
        """The last step whose groups may be acknowledged (see committed()); -1: none yet."""
        if not self.checkpointed:
            return -1
        if everything:
            return self.checkpointed[-1]
        return self.checkpointed[-2] if len(self.checkpointed) > 1 else self.resumed_step

    def _settle_upto(self, upto: int) -> int:
        """Acknowledge the held groups of steps up to `upto`; how many. The held count in Redis is then outdated."""
        done = [(s, pairs) for s, pairs in self.unsettled if s <= upto]
        if not done:
            return 0
        self.buffer.settle((eid, gid, "trained", s) for s, pairs in done for eid, gid in pairs)
        self.unsettled = [(s, pairs) for s, pairs in self.unsettled if s > upto]
        self.held_outdated = True
        return sum(len(pairs) for _, pairs in done)

    def _write_held(self) -> None:
        self._book("updating the held count", lambda: self.buffer.set_held(self.held()))
        self.held_outdated = False

    def _book(self, what: str, write: Callable[[], T]) -> T:
        """`write` (one of the books' writes) once the buffer takes it. At maxmemory (noeviction) Redis refuses it
        and every append, so waiting frees nothing: only settling does (SETTLE's first write, XACK, is allowed at
        maxmemory, and its XDELs free the groups' entries). So the groups already acknowledgeable, by the
        checkpoints committed so far, are settled first, then `write` is tried again. That is what committed()
        would settle next anyway, with its checkpoint records written after instead of before: the records only
        tell the audit the last trainer's final step, and a resumed trainer's start record names its checkpoint."""
        def attempt() -> T:
            try:
                return write()
            except BufferUnavailable as exc:
                if not is_out_of_memory(exc):
                    raise
                self._poll_checkpoints()
                freed = self._settle_upto(self._acknowledgeable())
                if not freed:
                    raise  # nothing to free: wait (an operator raises maxmemory) as for any unavailable Redis
                log.warning("Redis is at maxmemory and refused %s: acknowledged %d trained groups first to free "
                            "memory", what, freed)
            return write()
        return self.available(what, attempt)

    def _compact(self, upto: int) -> str:
        """Compact the trail through `upto`; why it stopped short ('' when it did not). At maxmemory its transaction
        is refused whole: skipped until the next acknowledged checkpoint rather than waited for (it never frees
        what its own writes need)."""
        try:
            return self.buffer.compact_audit(upto).held_back
        except BufferUnavailable as exc:
            if not is_out_of_memory(exc):
                raise
            return f"Redis is at maxmemory ({exc}); tried again at the next acknowledged checkpoint"

    def resume(self, updater: PolicyUpdater) -> Resumed | None:
        """Restore the newest valid checkpoint (there is at least one) and settle the groups it holds; None when
        every one was unusable. The state comes back as full trees (`params`, `opt_state`, `ref_params` when a KL
        reference is held): with LoRA the adapters joined with the frozen base read from `lora-base/`."""
        cfg = self.cfg
        updater_like = updater_state(updater)
        if not cfg.checkpoint.resume:
            raise RunRefused(f"checkpoint.dir {self.checkpoints.directory} holds checkpoints (steps "
                             f"{self.checkpoints.steps()}) and checkpoint.resume=false: choose a new checkpoint.dir "
                             "(and run.name) or resume")
        if self.cfg.model.lora is not None:  # before any array is read: alpha alone changes no shape
            check_settings(self.checkpoints.directory, lora_settings(cfg))
        restored = self.checkpoints.restore_latest(updater_like, layout_settings(cfg))
        if restored is None:
            return None
        record = restored.record
        if record.get("run") != cfg.run.name:
            raise RunRefused(f"checkpoint.dir {self.checkpoints.directory}: its newest usable checkpoint (step "
                             f"{restored.step}) belongs to run {record.get('run')!r}, not run.name={cfg.run.name!r}; "
                             "use that run's name or another dir (or, if that run wrote into this one, move its "
                             f"{self.checkpoints.directory / str(restored.step)} out)")
        # the base before any group is settled: without it the run cannot go on from here
        state = dict(restored.state)
        if "adapters" in state:
            frozen = self.checkpoints.restore_base(updater.split(updater.params)[1])
            self.base_saved = True
            state["params"] = updater.join(state.pop("adapters"), frozen)
            if "ref_adapters" in state:
                state["ref_params"] = updater.join(state.pop("ref_adapters"), frozen)
        settled = self.available("settling the resumed checkpoint's groups", lambda: self.buffer.settle(
            (eid, gid, "trained", s) for eid, gid, s in record["unsettled"]))
        self.data_position = dict(record.get("data_position", {}))
        self.buffer_position = record.get("buffer_position", "0-0")
        self.resumed_step = restored.step
        log.info("resumed at step %d (written by trainer %s); acknowledged %d groups it already held", restored.step,
                 record["epoch"], settled)
        return Resumed(restored.step, state, record)

    # -- the core's CheckpointKeeper (core.py): process 0's checkpoints, with their bookkeeping -------------------
    def restore(self, step: int, updater: PolicyUpdater) -> Resumed | None:
        """The checkpoint process 0 chose (`step`: the newest; with one process an older one when it is unusable),
        its groups settled and the start audited; None when every one was unusable."""
        resumed = self.resume(updater)
        if resumed is not None:
            self.available("auditing the start", lambda: self.buffer.log_trainer(
                self.epoch, resumed.step, resumed.record["epoch"]))
            self.available("updating the held count", lambda: self.buffer.set_held(0))  # a dead one's count
        return resumed

    def begin_new_run(self) -> None:
        """A run without a checkpoint: refuse one whose groups were acknowledged (its checkpoints are elsewhere)."""
        trained = self.available("reading the buffer counters", self.buffer.counters)["trained"]
        if not trained:
            self.available("auditing the start", lambda: self.buffer.log_trainer(self.epoch, 0, ""))
            self.available("updating the held count", lambda: self.buffer.set_held(0))
            return
        # acknowledged groups exist only once a checkpoint held them: the run's checkpoints are elsewhere, or every
        # one here was unusable (starting over would train those groups' successors on the initial weights)
        held = f"Redis already holds run {self.cfg.run.name!r} with {trained} trained groups, but"
        aside = self.checkpoints.moved_aside()
        if aside:
            raise RunRefused(
                f"{held} every checkpoint in {self.checkpoints.directory} (checkpoint.dir) was unusable and was moved "
                f"aside ({', '.join(aside[:6])}; the log says why): put a sound copy of one back as <step>/ to resume "
                "(an unverified-<step>-* one lacks only its digest: rename it to <step> and resume with "
                "checkpoint.verify=false), or choose a new run.name")
        raise RunRefused(
            f"{held} {self.checkpoints.directory} (checkpoint.dir) has no checkpoint of it: point checkpoint.dir "
            "(or --run-dir) at that run's checkpoints to resume it, or choose a new run.name")
