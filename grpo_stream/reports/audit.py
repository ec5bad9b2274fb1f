"""`grpo-stream audit RUN_DIR`: what happened to every rollout group the ingest accepted.

The buffer keeps an audit trail in Redis (common/rollouts/buffer.py): each accepted group, each settled one with
its outcome, each trainer start (and the checkpoint it resumed from), each trained step with its group
ids, and each saved checkpoint. From these the audit rebuilds the lineage of the final model: the steps
of the last trainer up to its last checkpoint, then those of the trainer it resumed from up to that
checkpoint, and so on. Steps a crash rolled back are not in it. Then, per accepted group:

  trained     in exactly one step of the lineage
  duplicated  in more than one (the guarantee is broken)
  dropped     settled as dropped (stale, invalid, zero-variance, second copy) and in no lineage step
  waiting     still in the buffer, in no lineage step (a continued run trains or drops it)
  lost        none of these (the guarantee is broken)

Groups, steps and checkpoint records the trainer compacted (common/rollouts/audit_compaction.py: settled behind the
acknowledged checkpoint, checked as above when compacted) are counted from P:R:audit:compacted; the lineage is
rebuilt for the steps after it. The compacted steps must still be the final model's (a resume from a checkpoint
before them rolled them back: `compacted.rolled_back`), and every entry in the buffer must have been accepted.

Answers to injected prompts submitted with train=false are kept apart (P:R:audit:eval) and never enter the
rollout stream; the audit checks that no trained step, of any trainer, lists one (else it is BROKEN), and counts
the injected train=true groups trained.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys

import redis

from grpo_stream.common.rollouts.audit_compaction import (CHECKPOINTS_FIELD, compacted_rolled_back, distinct_steps,
                                                          lineage, lineage_windows, read_compacted)
from grpo_stream.common.rollouts.audit_trail import (THROUGH_EPOCH_FIELD, group_records, kind_ok, read_compacted_fields,
                                                     read_trail, text)
from grpo_stream.common.rollouts.buffer import COUNTERS, REFUSALS, RUN_FILE, keys
from grpo_stream.common.rollouts.kept_results import RELEASED_FIELD
from grpo_stream.common.config.access import REDIS_PASSWORD_ENV
from grpo_stream.common.runtime.files import to_json, write_atomic


def build_audit(client: redis.Redis, run_name: str, prefix: str = "grpo-stream") -> dict:
    k = keys(prefix, run_name)
    if not client.exists(*k.values()):  # a wrong --redis-url or db, a misspelt run, or a Redis that lost its data
        raise ValueError(f"this Redis holds nothing of run {run_name!r} (no key {prefix}:{run_name}:*), so there is "
                         "nothing to audit: point --redis-url at the run's Redis (and database), or restore its data")
    # what compaction folded (audit_compaction.py): steps up to `through` were checked then, as below
    trail, through, compacted = _read_between_compactions(client, k)
    accepted, settled, second_copies, evaluated, waiting = (trail[name] for name in (
        "accepted", "settled", "second_copies", "evaluation_only", "waiting"))
    trainers, steps, checkpoints = trail["trainers"], trail["steps"], trail["checkpoints"]
    damaged = trail["damaged"]  # records left out (audit_trail.py): the audit cannot vouch for what they describe
    history, final_step, windows = _lineage(k, trainers, steps, checkpoints, damaged)
    numbers = read_compacted_fields(client, k["audit:compacted"])[0]  # a wrong type: described above, read as {}
    through_epoch = text(client.hget(k["audit:compacted"], THROUGH_EPOCH_FIELD) or b"") if kind_ok(
        client, k["audit:compacted"], "hash", None) else ""
    # the folded steps must still be the final model's: a resume from before them rolled them back
    rolled_back = compacted_rolled_back(windows, through, through_epoch)
    # train=false answers whose prompts have left Redis (kept_results.py): counted, no longer checked against steps
    released = numbers.get(RELEASED_FIELD, 0)
    times = collections.Counter(g for groups in history.values() for g in groups)
    ever_trained = {g for rec in steps for g in json.loads(rec["groups"])}  # rolled-back steps included
    eval_trained = sorted(set(evaluated) & ever_trained)
    outcome: dict[str, str] = {}
    for gid in accepted:
        n, rec = times.get(gid, 0), settled.get(gid)
        if n > 1:
            outcome[gid] = "duplicated"
        elif n == 1:
            outcome[gid] = "trained" if rec is None or rec["outcome"] == "trained" else "duplicated"
        elif rec is not None and rec["outcome"] != "trained":
            outcome[gid] = rec["outcome"]
        elif gid in waiting:
            outcome[gid] = "waiting"
        else:
            outcome[gid] = "lost"
    counts = collections.Counter(outcome.values())
    counters = _counters(client, k["counters"], damaged)
    missing_steps = sorted(set(range(through + 1, final_step + 1)) - set(history))
    injected_train = [g for g, rec in accepted.items() if rec.get("prompt")]
    # only the ingest's append writes the stream, with the accepted record; compaction folds only settled groups
    unaccepted = _not_accepted_now(client, k, {g for g in waiting if g is not None} | set(times), accepted)
    unaccepted_waiting = sorted(g for g in waiting if g in unaccepted)
    return {
        "run": run_name,
        "groups_accepted": len(accepted) + compacted["accepted"],
        "groups_trained": counts["trained"] + compacted["trained"],
        "groups_dropped": {name: counts[name] + compacted[name]
                           for name in ("dropped_stale", "dropped_invalid", "dropped_filtered")},
        "groups_waiting": counts["waiting"],
        "groups_lost": counts["lost"],
        "groups_trained_twice": counts["duplicated"],
        "second_copies_refused_by_ingest": counters["refused_duplicate"],
        "second_copies_dropped_by_trainer": sum(second_copies.values()) + compacted["second_copies_dropped"],
        "trained_but_not_accepted": sorted(set(times) & unaccepted)[:20],
        "waiting_but_not_accepted": unaccepted_waiting[:20],
        "lost_ids": sorted(g for g, o in outcome.items() if o == "lost")[:20],
        "trained_twice_ids": sorted(g for g, o in outcome.items() if o == "duplicated")[:20],
        "final_step": final_step,
        "lineage_missing_steps": missing_steps[:20],
        # trainers, steps and checkpoints, not their records: one can have two (distinct_steps)
        "trainer_starts": len({t["epoch"] for t in trainers}),
        "trainer_resumes": len({t["epoch"] for t in trainers if t["from_epoch"]}),
        "steps_rolled_back": distinct_steps(steps) - len(history) + compacted["steps_rolled_back"],
        "compacted": {"through_step": through, "groups": compacted["accepted"], "rolled_back": rolled_back},
        "checkpoints_saved": distinct_steps(checkpoints) + numbers.get(CHECKPOINTS_FIELD, 0),
        "damaged_records": damaged[:20],
        "counters": counters,
        "injected": {"evaluation_only": len(evaluated) + released, "evaluation_only_released": released,
                     "evaluation_only_trained": len(eval_trained), "evaluation_only_trained_ids": eval_trained[:20],
                     "train": len(injected_train) + compacted["injected_train"],
                     "train_trained": sum(outcome[g] == "trained" for g in injected_train)
                     + compacted["injected_train_trained"]},
        "ok": not counts["lost"] and not counts["duplicated"] and not missing_steps and not (set(times) & unaccepted)
        and not eval_trained and not damaged and not unaccepted_waiting and not rolled_back,
    }


LIVE_READS = 5  # reads of a live run's trail a compaction may interrupt before the audit gives up


def _read_between_compactions(client: redis.Redis, k: dict[str, str]) -> tuple[dict, int, dict[str, int]]:
    """(the trail with the stream's group ids, through_step, compacted counts), read with no compaction in between:
    one that landed mid-read (the trainer of a live run compacts at every acknowledged checkpoint) folded groups the
    trail was read with and without, and the audit reported them lost or counted them twice. Compaction always moves
    through_step, so a read it interrupted is read again."""
    for _ in range(LIVE_READS):
        before = read_compacted(client, k["audit:compacted"])[0]
        trail = read_trail(client, k, waiting=True)
        through, compacted, _ = read_compacted(client, k["audit:compacted"], trail["damaged"])
        if through == before:
            return trail, through, compacted
    raise RuntimeError(f"{k['audit:compacted']}: the trainer compacted the audit trail during each of {LIVE_READS} "
                       "reads of it; run audit again (or once the run has stopped)")


def _not_accepted_now(client: redis.Redis, k: dict[str, str], ids: set[str], accepted: dict) -> set[str]:
    """Of `ids` (in the stream or in a step), those with no accepted record, even now: a live run's ingest appends
    while the audit reads, and a group appended after the accepted records were read is in the stream (or already
    in a step) read later without being one."""
    ids = sorted(set(ids) - set(accepted))
    if not ids or not kind_ok(client, k["audit:accepted"], "hash", None):
        return set(ids)
    return {g for i in range(0, len(ids), 1000)
            for g, raw in zip(ids[i:i + 1000], client.hmget(k["audit:accepted"], ids[i:i + 1000])) if raw is None}


def _lineage(k: dict[str, str], trainers: list[dict], steps: list[dict], checkpoints: list[dict], damaged: list[str]
             ) -> tuple[dict[int, list[str]], int, list]:
    """lineage() and lineage_windows(), or a ValueError (audit exits 2: it could not judge) naming the trainer
    records and the damaged ones left out (a trainer's start record among them ended the audit with a bare
    "no start record", naming neither)."""
    try:
        return (*lineage(trainers, steps, checkpoints), lineage_windows(trainers, checkpoints))
    except ValueError as exc:
        why = (f"damaged records were left out: {'; '.join(damaged[:5])}" if damaged else
               f"restore the trainer's start record (XADD {k['audit:trainers']} * epoch E from_step N from_epoch F)")
        raise ValueError(f"{k['audit:trainers']}: {exc}, so the final model's lineage cannot be rebuilt; {why}") \
            from None


def _counters(client: redis.Redis, key: str, damaged: list[str]) -> dict[str, int]:
    """The buffer's counters; one that is no integer reads 0 and is described in `damaged` (a bare int() ended the
    audit with "invalid literal for int()", naming no key)."""
    raw = client.hgetall(key) if kind_ok(client, key, "hash", damaged) else {}
    out = {}
    for name in COUNTERS + REFUSALS:
        try:
            out[name] = int(raw.get(name.encode(), 0))
        except ValueError:
            out[name] = 0
            damaged.append(f"{key} field {name!r} holds {text(raw[name.encode()])[:40]!r}, not an integer: restore it "
                           f"(HSET {key} {name} N)")
    return out


def group_history(client: redis.Redis, run_name: str, group_id: str, prefix: str = "grpo-stream") -> dict:
    """Everything the trail says about one group, rolled-back steps included (nothing, once compacted); records
    that are not grpo-stream's are left out and described in `damaged` (audit_trail.py)."""
    return {"group_id": group_id, **group_records(client, keys(prefix, run_name), group_id)}


def read_run_file(path: pathlib.Path) -> dict:
    """The run file a trainer writes in RUN_DIR (its run name and Redis URL); a ValueError names the file when it
    is damaged, so audit exits 2 (could not judge) rather than 1, which means groups were lost."""
    try:
        info = json.loads(path.read_text(errors="replace"))
    except ValueError as exc:
        info, why = None, f"not JSON ({exc})"
    else:
        why = "no \"run\" and \"redis_url\" text fields"
    if not (isinstance(info, dict) and all(isinstance(info.get(k), str) for k in ("run", "redis_url"))):
        raise ValueError(f"{path}: {why}; the audit takes the run's name from it. A trainer writes it at each "
                         "start: start the run again on this directory (`up` or `trainer --run-dir`) to rewrite it")
    return info


RUN_LOCK_WAIT_S = 5.0  # how long audit waits for a run directory a stopping run still holds


def _client_for(run_dir: pathlib.Path, redis_url: str | None):
    """(client, run name, what to close after: an embedded server and the run directory's lock, or None): the URL
    given, else the run's own Redis if it answers, else an embedded Redis started on the run's data directory
    (RUN_DIR/redis, written by `up`), only while no run holds the directory: a second server on a live run's
    append-only file would corrupt it, and rewrite its clients' password file."""
    from grpo_stream.common.rollouts.redis_protection import read_password  # noqa: PLC0415
    from grpo_stream.common.rollouts.redis_server import (RedisConnectError, RedisUnreachable,  # noqa: PLC0415
                                                          connect)
    from grpo_stream.up.run_lock import RunDirBusy, RunLock  # noqa: PLC0415

    info_path = run_dir / RUN_FILE
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path}: not found; RUN_DIR must be a directory a trainer wrote")
    info = read_run_file(info_path)
    # a protected Redis: the password comes from the environment, as for the services
    login = {"password": os.environ[REDIS_PASSWORD_ENV]} if os.environ.get(REDIS_PASSWORD_ENV) else {}
    if redis_url:
        return connect(redis_url, 10, **login), info["run"], None
    # the run's own Redis: an embedded one (`up`) keeps its password in its data directory, for the run's clients
    own = login or ({"password": password} if (password := read_password(run_dir / "redis")) else {})
    try:
        return connect(info["redis_url"], 1, log_retries=False, **own), info["run"], None
    except RedisUnreachable as exc:  # a server that answered and refused (a wrong password) is raised as it is
        data = run_dir / "redis"
        if not data.is_dir():
            raise RedisConnectError(f"{exc}; pass --redis-url (and $GRPO_STREAM_REDIS_PASSWORD) to audit a run whose "
                                    "Redis is elsewhere") from None
        try:
            # a run that has just ended lets go of the directory moments after its processes show as gone
            lock = RunLock.acquire(run_dir, "audit", wait_s=RUN_LOCK_WAIT_S)
        except RunDirBusy as busy:
            raise RedisConnectError(f"{exc}; the run is still live, so audit starts no Redis of its own on its data "
                                    f"({busy}). Retry once its Redis answers, or pass --redis-url (and "
                                    f"${REDIS_PASSWORD_ENV})") from None
    try:
        server = own_redis(data, lock.fd).start()
    except BaseException:
        lock.release()
        raise
    return connect(server.url, 30, **server.client_options()), info["run"], (server, lock)


def own_redis(data: pathlib.Path, lock_fd: int):
    """The Redis audit starts on a stopped run's data (RUN_DIR/redis): it dies with audit (a killed audit left it on
    the run's AOF, the lock released, and the next `up` started a second Redis on the same file), and it holds the
    run directory's lock for as long as it lives, as `up`'s does."""
    from grpo_stream.common.rollouts.redis_server import EmbeddedRedis  # noqa: PLC0415
    from grpo_stream.common.runtime.process import die_with_parent  # noqa: PLC0415

    return EmbeddedRedis(data_dir=data, protected=True,
                         popen_options={"preexec_fn": die_with_parent(), "pass_fds": (lock_fd,)})


def run_audit(run_dir: pathlib.Path, redis_url: str | None, group: str | None, json_path: pathlib.Path | None) -> int:
    client, run_name, own = _client_for(run_dir, redis_url)
    try:
        if group:
            print(json.dumps(group_history(client, run_name, group), indent=2))
            return 0
        report = build_audit(client, run_name)
    finally:
        client.close()
        if own is not None:
            server, lock = own
            server.stop()
            lock.release()
    path = json_path or run_dir / "audit.json"
    write_atomic(path, to_json(report, indent=2))  # whole or not at all (common/runtime/files.py)
    d = report["groups_dropped"]
    print(f"run {run_name}: {report['groups_accepted']} groups accepted = {report['groups_trained']} trained + "
          f"{sum(d.values())} dropped (stale {d['dropped_stale']}, invalid {d['dropped_invalid']}, zero-variance "
          f"{d['dropped_filtered']}) + {report['groups_waiting']} waiting + {report['groups_lost']} lost; "
          f"{report['groups_trained_twice']} trained twice\n"
          f"final step {report['final_step']} over {report['trainer_starts']} trainer starts "
          f"({report['trainer_resumes']} resumed, {report['steps_rolled_back']} steps rolled back and replayed); "
          f"second copies refused by the ingest {report['second_copies_refused_by_ingest']}, dropped by the trainer "
          f"{report['second_copies_dropped_by_trainer']}\n"
          f"injected prompts: {report['injected']['evaluation_only']} evaluation-only answers "
          f"({report['injected']['evaluation_only_trained']} trained on), {report['injected']['train']} train=true "
          f"groups ({report['injected']['train_trained']} trained)\n"
          f"{'OK' if report['ok'] else 'BROKEN: see ' + str(path)}; written to {path}")
    if not report["ok"]:
        print(f"lost {report['lost_ids']}, trained twice {report['trained_twice_ids']}, missing steps "
              f"{report['lineage_missing_steps']}, trained with no accepted record (never accepted, or trained again after "
              f"compaction) {report['trained_but_not_accepted']}, "
              f"evaluation-only but trained {report['injected']['evaluation_only_trained_ids']}, in the buffer but "
              f"never accepted {report['waiting_but_not_accepted']}", file=sys.stderr)
        if report["compacted"]["rolled_back"]:
            print(report["compacted"]["rolled_back"], file=sys.stderr)
        for damage in report["damaged_records"]:  # each names its key and the command that removes it
            print(f"damaged record, left out of the audit: {damage}", file=sys.stderr)
    return 0 if report["ok"] else 1
