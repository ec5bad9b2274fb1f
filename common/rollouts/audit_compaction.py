"""Audit-trail retention: the records of groups settled behind the acknowledged checkpoint fold into counters.

Without it the trail grows by ~250 bytes per group for the whole run, and under `noeviction` a long run ends in OOM
replies. Steps up to the acknowledged checkpoint (`through_step`: the trainer acknowledges a step's groups only once
the checkpoint after the one holding it is on disk, and keeps at least two) can no longer be rolled back, so what
`grpo-stream audit` would conclude about their groups is final. Compaction checks it then, exactly as the audit
does, and keeps the verdict as counts in P:R:audit:compacted:

  through_step               lineage steps up to here are compacted
  through_epoch              the trainer whose lineage step through_step was: a later trainer that resumed from
                             before it rolled the compacted steps back (compacted_rolled_back)
  accepted, trained, dropped_stale, dropped_invalid, dropped_filtered, second_copies_dropped, steps_rolled_back,
  injected_train, injected_train_trained
  below:<sampler>            every group of that sampler at or below this data position is compacted, except at
  holes:<sampler>            the positions the watermark passed that never held an accepted group (intervals
                             "lo-hi,..."): a late group there is accepted, not refused (compaction_holes.py)
  checkpoints                checkpoint records folded: every trainer's but its newest, all the lineage reads

Only groups the audit would call settled are removed: trained in exactly one lineage step up to `through_step`, or
dropped (a drop is final). A group that is waiting, lost, trained twice or trained later stays, and so does every
later group of its sampler, so `below:<sampler>` stays exact and the ingest refuses a late second copy of a
compacted group as a duplicate (the accepted hash, the de-duplication set, no longer holds it). And a group goes only
with every group its lineage step lists: a step's record stays while any of them does, and the audit counts every
group a kept record lists (samplers send groups as they end, out of data-position order, so one step can hold groups
on both sides of a sampler's watermark). Injected answers
(no data position) are refused again by their prompt's state. A step the lineage lacks stops compaction there: the
audit must see it.
"""

from __future__ import annotations

import collections
import dataclasses
import json

import redis

from grpo_stream.common.rollouts import compaction_holes
from grpo_stream.common.rollouts.audit_trail import THROUGH_EPOCH_FIELD, read_compacted_fields, read_trail, text
from grpo_stream.common.rollouts.fencing import LOST_FENCE, STALE_CODE, StaleTrainer

DROPS = ("dropped_stale", "dropped_invalid", "dropped_filtered")
CHECKPOINTS_FIELD = "checkpoints"  # checkpoint records folded (folded_checkpoints): each trainer's newest stays
COMPACTED_COUNTS = ("accepted", "trained", *DROPS, "second_copies_dropped", "steps_rolled_back", "injected_train",
                    "injected_train_trained")


def lineage(trainers: list[dict], steps: list[dict], checkpoints: list[dict]) -> tuple[dict[int, list[str]], int]:
    """{step: group ids} of the final model's history, and its last step: the steps of the last trainer up to its
    last checkpoint, then those of the trainer it resumed from up to that checkpoint, and so on. Steps a crash
    rolled back are not in it. Step records are dicts with epoch, step and groups (a JSON list or a list)."""
    records, final = lineage_records(trainers, steps, checkpoints)
    return {step: _groups(rec) for step, rec in records.items()}, final


def lineage_records(trainers: list[dict], steps: list[dict], checkpoints: list[dict]) -> tuple[dict[int, dict], int]:
    """lineage() as {step: its step record}: a record is in the lineage by its trainer epoch and step, never by the
    groups it lists (a rolled-back step and its deterministic replay list the same groups)."""
    windows = lineage_windows(trainers, checkpoints)
    out = {}
    for epoch, after, upto in windows:
        for rec in steps:
            step = int(rec["step"])
            if rec["epoch"] == epoch and after < step <= upto:
                out[step] = rec
    return out, windows[0][2] if windows else 0


def lineage_windows(trainers: list[dict], checkpoints: list[dict]) -> list[tuple[str, int, int]]:
    """The final model's history as (trainer epoch, from_step, upto): that trainer's steps in (from_step, upto] are
    in the lineage; the last trainer first, back to the fresh start."""
    if not trainers:
        return []
    by_epoch = {t["epoch"]: t for t in trainers}
    epoch = trainers[-1]["epoch"]
    saved = [int(c["step"]) for c in checkpoints if c["epoch"] == epoch]
    upto = max(saved, default=int(by_epoch[epoch]["from_step"]))
    out, seen = [], set()
    while epoch:
        if epoch in seen:  # only a hand-edited trail resumes in a circle: without this, an endless loop
            raise ValueError(f"the audit trail's trainer starts resume in a circle through trainer {epoch}")
        seen.add(epoch)
        start = by_epoch[epoch]
        out.append((epoch, int(start["from_step"]), upto))
        upto, epoch = int(start["from_step"]), start["from_epoch"]
        if epoch and epoch not in by_epoch:
            raise ValueError(f"the audit trail names trainer {epoch} but has no start record for it")
    return out


def compacted_rolled_back(windows: list[tuple[str, int, int]], through_step: int, through_epoch: str) -> str:
    """Why the compacted steps are not the final model's ('' when they are): compaction folded steps up to
    `through_step` of the lineage whose step `through_step` trainer `through_epoch` trained; a trainer that resumed
    from a checkpoint before it (the two newest unusable: docs/operations.md, "Limits") rolled those steps back, so
    the groups counted as trained in them are in no step of the final model. '' too for a trail compacted before
    through_epoch was recorded."""
    if not through_step or not through_epoch:
        return ""
    owner = next((epoch for epoch, after, upto in windows if after < through_step <= upto), None)
    if owner == through_epoch:
        return ""
    resumed = next(((epoch, after) for epoch, after, _ in windows if after < through_step), None)
    how = f"trainer {resumed[0]} resumed from step {resumed[1]}" if resumed else "no trainer's history reaches it"
    return (f"compaction folded steps up to {through_step} as trained by trainer {through_epoch}, but the final "
            f"model's lineage does not go through them ({how}): the groups counted as trained in the steps after "
            "that checkpoint are lost")


@dataclasses.dataclass
class CompactionPlan:
    """What one compaction removes and adds. `counts` are increments; `below` the new per-sampler watermarks."""

    through_step: int
    group_ids: list[str]
    step_records: list[str]  # ids of step records removed (lineage steps compacted, and rolled-back ones)
    counts: dict[str, int]
    below: dict[str, int]
    held_back: str = ""  # why compaction stopped short of through_step, if it did
    holes: dict[str, str] = dataclasses.field(default_factory=dict)  # sampler -> its holes now (compaction_holes)
    through_epoch: str = ""  # the trainer whose lineage step through_step is (compacted_rolled_back checks it)


def plan_compaction(through_step: int, previous_through: int, accepted: dict[str, dict], settled: dict[str, dict],
                    second_copies: dict[str, int], steps: list[dict], trainers: list[dict], checkpoints: list[dict],
                    evaluation_only: dict[str, dict], below: dict[str, int], holes: dict[str, str] | None = None,
                    through_epoch: str = "") -> CompactionPlan:
    """The pure decision: which records of the trail can fold into counts once steps up to `through_step` are final.
    Step records carry their record id as `id`. Evaluation-only answers (P:R:audit:eval) are only checked, never
    removed: `audit --group` finds a probe's answer for as long as its prompt keeps its result. `holes`: each
    sampler's positions below its watermark never accepted (as stored; compaction_holes.py). `through_epoch`: the
    trainer whose step previous_through was folded ('' when not recorded)."""
    empty = CompactionPlan(previous_through, [], [], dict.fromkeys(COMPACTED_COUNTS, 0), {})
    if through_step <= previous_through:
        return empty
    try:
        records, _ = lineage_records(trainers, steps, checkpoints)
        windows = lineage_windows(trainers, checkpoints)
    except ValueError as exc:  # a trail the audit cannot follow: compaction must not decide for it
        empty.held_back = str(exc)
        return empty
    # what was folded must still be the final model's history, else its counts are not final: the audit says so
    empty.held_back = compacted_rolled_back(windows, previous_through, through_epoch)
    if empty.held_back:
        return empty
    history = {step: _groups(rec) for step, rec in records.items()}
    missing = [s for s in range(previous_through + 1, through_step + 1) if s not in history]
    if missing:
        empty.held_back = f"lineage steps {missing[:5]} have no record"
        return empty
    final = {s: gids for s, gids in history.items() if s <= through_step}
    # counted over the whole lineage, not only up to through_step: a group trained again in a later step must stay
    # (folded, the later step's record would list a group the trail no longer knows, and the audit could not tell)
    times = collections.Counter(g for gids in history.values() for g in gids)

    def settled_now(gid: str) -> bool:
        rec = settled.get(gid)
        if rec is None:
            return False
        if rec["outcome"] == "trained":
            return times.get(gid, 0) == 1
        return times.get(gid, 0) == 0 and rec["outcome"] in DROPS

    # a step's record stays while any of its groups does, and the audit then counts every group it lists: so a
    # group goes only with all of its step's (samplers send groups as they end, out of data-position order, so a
    # step can hold groups on both sides of a sampler's watermark); a group held back holds back its step's others
    step_of = {g: s for s, gids in final.items() for g in gids}
    held: set[str] = set()
    while True:
        chosen, new_below, passed = _chosen(accepted, lambda g: settled_now(g) and step_of.get(g) not in held, below)
        gone = set(chosen)
        mixed = {s for s, gids in final.items() if s not in held and any(g in gone for g in gids)
                 and any(g not in gone and g in accepted for g in gids)}
        if not mixed:
            break
        held |= mixed
    new_holes = _holes_after(passed, below, holes or {})
    counts = dict.fromkeys(COMPACTED_COUNTS, 0)
    for gid in chosen:
        outcome = settled[gid]["outcome"]
        counts["accepted"] += 1
        counts[outcome] += 1
        counts["second_copies_dropped"] += second_copies.get(gid, 0)
        if accepted[gid].get("prompt"):
            counts["injected_train"] += 1
            counts["injected_train_trained"] += outcome == "trained"
    # Step records that go: those a crash rolled back at or below through_step (the lineage holds the one record
    # of each such step that counts), and lineage records whose every group is compacted, now or before (the
    # audit still needs the record of a group that stays). An evaluation-only answer listed in any of them is a
    # broken guarantee the audit must show, so compaction then leaves everything.
    lineage_ids = {(rec["epoch"], int(rec["step"])) for step, rec in records.items() if step in final}
    gone = set(chosen)
    rolled_back = [rec for rec in steps if int(rec["step"]) <= through_step
                   and (rec["epoch"], int(rec["step"])) not in lineage_ids]
    removed = rolled_back + [rec for rec in steps if (rec["epoch"], int(rec["step"])) in lineage_ids
                             and all(g in gone or g not in accepted for g in _groups(rec))]
    empty.held_back = _unaccounted(removed, rolled_back, accepted, evaluation_only)
    if empty.held_back:
        return empty
    counts["steps_rolled_back"] = distinct_steps(rolled_back)
    owner = next(epoch for epoch, after, upto in windows if after < through_step <= upto)
    return CompactionPlan(through_step, chosen, [rec["id"] for rec in removed], counts, new_below, holes=new_holes,
                          through_epoch=owner)


def _holes_after(passed: dict[str, list[int]], below: dict[str, int], holes: dict[str, str]) -> dict[str, str]:
    """Each sampler's holes once its watermark moved through the `passed` positions (only samplers whose changed):
    positions the watermark jumps over may still arrive, so they are not duplicates; ones filled are."""
    out: dict[str, str] = {}
    for sampler, positions in passed.items():
        old = below.get(sampler, -1)
        gaps, filled = compaction_holes.passed_over(old, positions), [p for p in positions if p <= old]
        if gaps or filled:
            out[sampler] = compaction_holes.updated(holes.get(sampler), gaps, filled)
    return out


def _unaccounted(removed: list[dict], rolled_back: list[dict], accepted: dict[str, dict],
                 evaluation_only: dict[str, dict]) -> str:
    """Why step records must not go ('' when they may): one lists an evaluation-only answer, or a lineage one lists
    a group the trail has no accepted record of. A group folded earlier went with every lineage record listing it,
    so such a group was never accepted, or was trained again after it was folded: the audit must see the record."""
    listed = {g for rec in removed for g in _groups(rec)}
    if listed & set(evaluation_only):
        return f"evaluation-only answers {sorted(listed & set(evaluation_only))[:5]} were trained"
    rolled_back_ids = {rec["id"] for rec in rolled_back}
    unknown = sorted({g for rec in removed if rec["id"] not in rolled_back_ids for g in _groups(rec)} - set(accepted))
    if unknown:
        return (f"lineage steps list groups {unknown[:5]} that have no accepted record: never accepted, or trained "
                "again after they were compacted")
    return ""


def _chosen(accepted: dict[str, dict], goes, below: dict[str, int]
            ) -> tuple[list[str], dict[str, int], dict[str, list[int]]]:
    """(groups that go, each sampler's new watermark, the positions it passed): per sampler in data-position order
    up to the first group that must stay; groups without a position (injected answers) each on their own."""
    by_sampler: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    chosen: list[str] = []
    for gid, rec in accepted.items():
        position = int(rec.get("position", -1))
        if position >= 0:
            by_sampler[rec["sampler"]].append((position, gid))
        elif goes(gid):
            chosen.append(gid)
    new_below: dict[str, int] = {}
    passed: dict[str, list[int]] = {}
    for sampler, groups in by_sampler.items():
        for position, gid in sorted(groups):
            if not goes(gid):
                break
            chosen.append(gid)
            new_below[sampler] = max(position, below.get(sampler, -1))
            passed.setdefault(sampler, []).append(position)
    return chosen, new_below, passed


def distinct_steps(records: list[dict]) -> int:
    """How many (trainer epoch, step) the step or checkpoint `records` name: redis-py re-sends a command whose reply
    was lost (a timeout, a dropped connection), so one step or checkpoint can have two records."""
    return len({(rec["epoch"], int(rec["step"])) for rec in records})


def folded_checkpoints(checkpoints: list[dict]) -> tuple[list[str], int]:
    """(ids of the checkpoint records that go, how many checkpoints they record): all but each trainer's newest,
    the only one the lineage reads (lineage_windows: the last trainer's newest step). One record per checkpoint for
    the whole run otherwise: a long run with checkpoint.every=1 grew by ~35 bytes a step, and every compaction read
    them all. A checkpoint recorded twice (distinct_steps) counts once."""
    newest: dict[str, dict] = {}
    for rec in checkpoints:
        if rec["epoch"] not in newest or int(rec["step"]) > int(newest[rec["epoch"]]["step"]):
            newest[rec["epoch"]] = rec
    kept = {rec["id"] for rec in newest.values()}
    gone = [rec for rec in checkpoints if rec["id"] not in kept]
    folded = {(r["epoch"], int(r["step"])) for r in gone} - {(r["epoch"], int(r["step"])) for r in newest.values()}
    return [rec["id"] for rec in gone], len(folded)


def _groups(rec: dict) -> list[str]:
    groups = rec["groups"]
    return json.loads(groups) if isinstance(groups, str) else list(groups)


def read_compacted(client, key: str, damaged: list[str] | None = None) -> tuple[int, dict[str, int], dict[str, int]]:
    """(through_step, counts, below) from P:R:audit:compacted (zeros for a run never compacted); a damaged field is
    left out and described in `damaged` (audit_trail.py)."""
    raw, _ = read_compacted_fields(client, key, damaged)
    counts = {name: raw.get(name, 0) for name in COMPACTED_COUNTS}
    below = {k[len("below:"):]: v for k, v in raw.items() if k.startswith("below:")}
    return raw.get("through_step", 0), counts, below


def compact_redis(client, k: dict[str, str], through_step: int, fence: tuple[str, str] | None = None
                  ) -> CompactionPlan:
    """Read the run's trail, plan, and apply the plan in one MULTI/EXEC (readers never see half of it; the ingest's
    append sees the new watermarks as soon as the accepted records are gone). `fence`: (the fence key, the trainer's
    fencing number): the transaction WATCHes the key and applies only while it holds that number, else raises
    StaleTrainer (trainer_lease.py)."""
    if fence is not None:  # a stale trainer learns it before the reading, not only at the write
        _check_fence(client.get(fence[0]), fence[1])
    damaged: list[str] = []
    previous, counts, below = read_compacted(client, k["audit:compacted"], damaged)
    if through_step <= previous and not damaged:
        return CompactionPlan(previous, [], [], dict.fromkeys(counts, 0), {})
    trail = read_trail(client, k)
    damaged += trail["damaged"]
    if damaged:  # what compaction would fold or overwrite cannot be checked: the trail stays as it is
        return CompactionPlan(previous, [], [], dict.fromkeys(counts, 0), {}, held_back=(
            f"{len(damaged)} damaged records in the audit trail, e.g. {'; '.join(damaged[:3])}"))
    _, holes = read_compacted_fields(client, k["audit:compacted"])
    through_epoch = text(client.hget(k["audit:compacted"], THROUGH_EPOCH_FIELD) or b"")
    plan = plan_compaction(through_step, previous, trail["accepted"], trail["settled"], trail["second_copies"],
                           trail["steps"], trail["trainers"], trail["checkpoints"], trail["evaluation_only"], below,
                           holes, through_epoch)
    if plan.through_step <= previous:
        return plan
    pipe = client.pipeline(transaction=True)
    if fence is not None:
        _watch_fence(pipe, *fence)
    for name, n in plan.counts.items():
        if n:
            pipe.hincrby(k["audit:compacted"], name, n)
    pipe.hset(k["audit:compacted"], mapping={"through_step": plan.through_step, THROUGH_EPOCH_FIELD: plan.through_epoch,
                                             **{f"below:{s}": p for s, p in plan.below.items()},
                                             **{f"holes:{s}": h for s, h in plan.holes.items() if h}})
    if any(not h for h in plan.holes.values()):
        pipe.hdel(k["audit:compacted"], *[f"holes:{s}" for s, h in plan.holes.items() if not h])
    for key, ids in ((k["audit:accepted"], plan.group_ids), (k["audit:settled"], plan.group_ids),
                     (k["audit:duplicates"], [g for g in plan.group_ids if g in trail["second_copies"]])):
        for i in range(0, len(ids), 1000):
            pipe.hdel(key, *ids[i:i + 1000])
    for i in range(0, len(plan.step_records), 1000):
        pipe.xdel(k["audit:steps"], *plan.step_records[i:i + 1000])
    gone, folded = folded_checkpoints(trail["checkpoints"])
    if folded:
        pipe.hincrby(k["audit:compacted"], CHECKPOINTS_FIELD, folded)
    for i in range(0, len(gone), 1000):
        pipe.xdel(k["audit:checkpoints"], *gone[i:i + 1000])
    try:
        pipe.execute()
    except redis.WatchError as exc:
        _fence_moved_or_connection_lost(client, fence, exc)
    return plan


def _fence_moved_or_connection_lost(client, fence: tuple[str, str], exc: redis.WatchError) -> None:
    """Why the compaction's transaction was refused: a trainer started (the fence moved) between the check and
    EXEC, or the connection dropped while the key was WATCHed (redis-py raises WatchError for that too, e.g. when
    Redis is restarted; seen: a supervised run whose Redis was killed mid-compaction stopped as a stale trainer).
    The fence, read again, tells them apart: moved, StaleTrainer; still this trainer's, the connection's failure,
    which the caller backs off and retries (as it does when this reading fails: Redis still down or loading). A
    retry is safe whether or not that EXEC ran: it moved through_step with its counts, so the next reading plans
    nothing twice."""
    current = client.get(fence[0])
    if current is None or text(current) != fence[1]:
        raise StaleTrainer(f"{STALE_CODE} the run's fence moved past {fence[1]} during compaction: a newer trainer "
                           "took the run over") from None
    raise redis.ConnectionError(f"the connection to Redis was lost during compaction ({exc})") from exc


def _watch_fence(pipe, key: str, fence: str) -> None:
    """WATCH the fence key and check it holds `fence` (StaleTrainer if not), then start the transaction."""
    pipe.watch(key)
    try:
        _check_fence(pipe.get(key), fence)
    except StaleTrainer:
        pipe.reset()
        raise
    pipe.multi()


def _check_fence(current, fence: str) -> None:
    if current is None:
        raise StaleTrainer(f"{STALE_CODE} this trainer holds fence {fence} but {LOST_FENCE}")
    if text(current) != fence:
        raise StaleTrainer(f"{STALE_CODE} this trainer holds fence {fence} but the run is at fence {text(current)}: a "
                           "newer trainer took the run over")

