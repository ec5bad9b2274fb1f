"""Reading a run's audit trail from Redis (the layout: buffer.py's docstring), record by record, defensively.

The trainer compacts the trail at every acknowledged checkpoint and `grpo-stream audit` reads all of it, so one
record that grpo-stream did not write (a foreign tool's field in the same hash, a hand edit, a partial restore) must
not stop either with a bare JSONDecodeError or KeyError at every checkpoint, after every restart. Each record is
checked for what its readers use; one that fails is left out of what is returned and described in `damaged`
(key, field or record id, what is wrong, and the command that removes it), so compaction can hold back and the
audit can report it.
"""

from __future__ import annotations

import json

from grpo_stream.common.rollouts.redis_errors import is_count

MAX_SHOWN = 40  # characters of a damaged value quoted in its description
THROUGH_EPOCH_FIELD = "through_epoch"  # P:R:audit:compacted's one text field (audit_compaction.py)


def text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def stream_records(client, key: str, only: tuple[str, ...] | None = None, record_ids: bool = False) -> list[dict]:
    """All records of a stream as text dicts, oldest first, in chunks (a long run's trail is large); `only`: just
    those fields; `record_ids`: each with its stream id as `id`."""
    out, start = [], "-"
    while True:
        chunk = client.xrange(key, min=start, count=1000)
        out += [{**({"id": text(i)} if record_ids else {}),
                 **{text(a): text(b) for a, b in fields.items() if only is None or text(a) in only}}
                for i, fields in chunk]
        if len(chunk) < 1000:
            return out
        ms, seq = map(int, text(chunk[-1][0]).split("-"))
        start = f"{ms}-{seq + 1}"


def _json_object(raw: str, needs: tuple[str, ...] = ()) -> dict | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) and all(name in value for name in needs) else None


def _accepted(raw: str) -> dict | None:
    """An accepted record as compaction reads it: a position (an integer; -1 or absent: none) and, with one, its
    sampler."""
    rec = _json_object(raw)
    if rec is None:
        return None
    position = rec.get("position", -1)
    if not isinstance(position, int) or isinstance(position, bool):
        return None
    return rec if position < 0 or isinstance(rec.get("sampler"), str) else None


def _integer(raw) -> int | None:
    """`raw` as an integer when Redis can count on it (is_count): compaction adds to the counts it reads with HINCRBY,
    inside a transaction whose other commands Redis runs even when one fails ('1_000' read by int() as 1000 deleted
    the folded groups' records and never added their count)."""
    return int(raw) if isinstance(raw, str) and is_count(raw) else None


def _group_list(raw) -> list | None:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, list) and all(isinstance(g, str) for g in value) else None


def _shown(raw) -> str:
    return repr(text(raw)[:MAX_SHOWN])


def kind_ok(client, key: str, kind: str, damaged: list[str] | None) -> bool:
    """Whether `key` is absent or of `kind` (a Redis type); else described in `damaged`. Redis's own WRONGTYPE reply
    names no key, and a read of one foreign key ended the audit (and every compaction) with it."""
    found = text(client.type(key))
    if found in ("none", kind):
        return True
    if damaged is not None:
        damaged.append(f"{key} is a {found}, not the {kind} the audit trail keeps there (something other than "
                       f"grpo-stream wrote it): restore it, or DEL {key} if it holds nothing of this run")
    return False


def _hash(client, key: str, parse, what: str, damaged: list[str]) -> dict:
    out = {}
    if not kind_ok(client, key, "hash", damaged):
        return out
    for field, raw in client.hscan_iter(key, count=1000):
        value = parse(text(raw))
        if value is None:
            damaged.append(f"{key} field {text(field)!r} holds {_shown(raw)}, not {what} (remove it: HDEL {key} "
                           f"{text(field)})")
        else:
            out[text(field)] = value
    return out


# what each stream's records must hold for the lineage and the audit: field -> check (None: damaged)
_RECORD_FIELDS = {
    "audit:trainers": {"epoch": str, "from_step": _integer, "from_epoch": str},
    "audit:checkpoints": {"epoch": str, "step": _integer},
    "audit:steps": {"epoch": str, "step": _integer, "groups": _group_list},  # read last: read_trail
}


def _records(client, key: str, fields: dict, damaged: list[str], record_ids: bool = False) -> list[dict]:
    out = []
    if not kind_ok(client, key, "stream", damaged):
        return out
    for rec in stream_records(client, key, record_ids=True):
        bad = [name for name, check in fields.items() if name not in rec or check(rec[name]) is None]
        if bad:
            damaged.append(f"{key} record {rec['id']} has no valid {', '.join(bad)} (remove it: XDEL {key} "
                           f"{rec['id']})")
            continue
        if not record_ids:
            del rec["id"]
        out.append(rec)
    return out


def read_trail(client, k: dict[str, str], waiting: bool = False) -> dict:
    """The audit trail of one run (keys `k`): accepted, settled, second_copies and evaluation_only by group id;
    trainers, checkpoints and steps (these two with their stream ids) as records; `damaged`: descriptions of the
    records left out (none for a trail grpo-stream wrote). What `audit` and compaction both read. `waiting`: also the
    group ids in the buffer's stream (`waiting`, a set).

    A live run writes while this reads, key by key, so the order is chosen for the audit: the stream after the
    accepted records and before the settled ones (a group settled in between is then seen waiting or settled, never
    neither: it was reported lost), and the steps and checkpoints after the settled records (a group settled
    trained is in a step and under a checkpoint read after it). A compaction in between is build_audit's to detect."""
    damaged: list[str] = []
    trail: dict = {"accepted": _hash(client, k["audit:accepted"], _accepted,
                                     "a JSON object with a sampler and position", damaged)}
    if waiting:
        trail["waiting"] = {rec.get("id") for rec in stream_records(client, k["rollouts"], only=("id",))} \
            if kind_ok(client, k["rollouts"], "stream", damaged) else set()
    trail.update({
        "settled": _hash(client, k["audit:settled"], lambda raw: _json_object(raw, ("outcome",)),
                         "a JSON object with an outcome", damaged),
        "second_copies": _hash(client, k["audit:duplicates"], _integer, "a count", damaged),
        "evaluation_only": _hash(client, k["audit:eval"], _json_object, "a JSON object", damaged)})
    for name, fields in _RECORD_FIELDS.items():
        trail[name[len("audit:"):]] = _records(client, k[name], fields, damaged, record_ids=name != "audit:trainers")
    trail["damaged"] = damaged
    return trail


def read_compacted_fields(client, key: str, damaged: list[str] | None = None) -> tuple[dict[str, int], dict[str, str]]:
    """P:R:audit:compacted as ({field: count}, {sampler: holes}); a field that is no integer (or holes that are no
    "lo-hi,..." list) is left out and described in `damaged`."""
    numbers, holes = {}, {}
    if not kind_ok(client, key, "hash", damaged):
        return numbers, holes
    for field, raw in client.hgetall(key).items():
        name, value = text(field), text(raw)
        if name == THROUGH_EPOCH_FIELD:  # a trainer epoch, not a count (read by itself)
            continue
        if name.startswith("holes:"):
            if all(len(part.split("-")) == 2 and all(p.isdigit() for p in part.split("-"))
                   for part in value.split(",") if value):
                holes[name[len("holes:"):]] = value
                continue
            what = "a list of intervals lo-hi,..."
        elif (number := _integer(value)) is not None:
            numbers[name] = number
            continue
        else:
            what = "an integer"
        if damaged is not None:
            damaged.append(f"{key} field {name!r} holds {_shown(value)}, not {what}: restore it (HSET {key} {name} "
                           f"...), or HDEL {key} {name} if it was not written by grpo-stream")
    return numbers, holes


def group_records(client, k: dict[str, str], group_id: str) -> dict:
    """What the trail says about one group (`audit --group`): its accepted, settled and evaluation-only records
    (None when absent), the steps that list it (rolled-back ones included) and `damaged`, as read_trail describes
    the records it had to leave out."""
    damaged: list[str] = []

    def one(key: str, parse, what: str):
        if not kind_ok(client, k[key], "hash", damaged):
            return None
        raw = client.hget(k[key], group_id)
        if raw is None:
            return None
        value = parse(text(raw))
        if value is None:
            damaged.append(f"{k[key]} field {group_id!r} holds {_shown(raw)}, not {what} (remove it: HDEL {k[key]} "
                           f"{group_id})")
        return value

    steps = _records(client, k["audit:steps"], _RECORD_FIELDS["audit:steps"], damaged)
    return {"accepted": one("audit:accepted", _json_object, "a JSON object"),
            "evaluation_only": one("audit:eval", _json_object, "a JSON object"),
            "settled": one("audit:settled", lambda raw: _json_object(raw, ("outcome",)), "a JSON object with an "
                           "outcome"),
            "trained_in_steps": [{"epoch": r["epoch"], "step": int(r["step"])} for r in steps
                                 if group_id in _group_list(r["groups"])],
            "damaged": damaged}
