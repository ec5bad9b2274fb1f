"""Reading back an offline W&B run directory (`wandb/offline-run-*/run-<id>.wandb`) without the network.

The .wandb file is the run's transaction log, which `wandb sync` uploads: LevelDB's log format (32 KiB blocks of
records, each `crc32: u32, length: u16, type: u8, data`, a long record split FIRST/MIDDLE.../LAST) after a 7-byte
W&B header (`:W&B`, magic 0xBEE1, version 0); each whole record is a serialized `wandb_internal_pb2.Record`. The
Python reader that shipped with wandb (`wandb.sdk.internal.datastore.DataStore`) left the package when wandb-core
took over writing, so this is the same format, read here with the Record type wandb still ships.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct
import time
import zlib

_BLOCK = 32768
_HEADER = struct.Struct("<IHB")  # checksum, length, type
_FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: pathlib.Path) -> list:
    """Every Record of a .wandb file, in order; AssertionError on a bad header, checksum or record sequence."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 - only tests that read runs need wandb

    data = pathlib.Path(path).read_bytes()
    assert _FILE_HEADER.unpack_from(data) == (b":W&B", 0xBEE1, 0), data[:7]
    pos, out, parts = _FILE_HEADER.size, [], None
    while pos + _HEADER.size <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER.size:  # a block's tail too short for a header is zero padding
            pos += _BLOCK - pos % _BLOCK
            continue
        checksum, length, kind = _HEADER.unpack_from(data, pos)
        chunk = data[pos + _HEADER.size:pos + _HEADER.size + length]
        pos += _HEADER.size + length
        if kind == 0 and length == 0:  # zeros at the end of an unfinished block
            continue
        assert checksum == zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF, f"bad checksum at {pos}"
        if kind == _FULL:
            out.append(wandb_internal_pb2.Record.FromString(chunk))
        elif kind == _FIRST:
            parts = [chunk]
        else:
            assert kind in (_MIDDLE, _LAST) and parts is not None, f"record type {kind} at {pos} out of sequence"
            parts.append(chunk)
            if kind == _LAST:
                out.append(wandb_internal_pb2.Record.FromString(b"".join(parts)))
                parts = None
    return out


def _put(target: dict, item) -> None:
    """An item (`key`, or `nested_key` [outer, ..., inner]) of a config, history or summary record into `target`:
    a logged object (a table, a histogram) is a dict under its key."""
    keys = list(item.nested_key) or [item.key]
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = json.loads(item.value_json)


@dataclasses.dataclass
class OfflineRun:
    """What an offline run logged: its identity (and exit code once finished), config, history rows (one per
    run.log call), summary, and its files directory."""

    directory: pathlib.Path
    run: dict
    config: dict
    history: list[dict]
    summary: dict

    def keys(self) -> set[str]:
        return {key for row in self.history for key in row}

    def column(self, key: str) -> list:
        return [row[key] for row in self.history if key in row]

    def table(self, value: dict) -> list[dict]:
        """The rows (column -> value) of a logged wandb.Table, from the history value that points at its file."""
        table = json.loads((self.directory / "files" / value["path"]).read_text())
        return [dict(zip(table["columns"], row)) for row in table["data"]]


def finished_records(path: pathlib.Path, timeout_s: float = 60.0) -> list:
    """The .wandb file's records once its exit record is there: wandb-core's service process writes the log on its
    own after `finish()` returns (on a loaded machine the file was still empty when read at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def read_run(directory: pathlib.Path) -> OfflineRun:
    """The offline run in `directory` (an `offline-run-*` folder), from its .wandb file."""
    directory = pathlib.Path(directory)
    (path,) = directory.glob("run-*.wandb")
    run, config, history, summary = {}, {}, [], {}
    kinds = []
    for record in finished_records(path):
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "run":
            r = record.run
            # wandb-core may write the run record again, after others (the exit record included): merge
            run.update({"id": r.run_id, "project": r.project, "entity": r.entity, "group": r.run_group,
                        "name": r.display_name})
            for item in r.config.update:
                _put(config, item)
        elif kind == "config":
            for item in record.config.update:
                _put(config, item)
        elif kind == "history":
            history.append({})
            for item in record.history.item:
                _put(history[-1], item)
        elif kind == "summary":
            for item in record.summary.update:
                _put(summary, item)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    assert "project" in run, f"no run record in {path}: {kinds}"
    return OfflineRun(directory, run, config, history, summary)


def offline_runs(root: pathlib.Path) -> list[pathlib.Path]:
    """The offline run directories W&B wrote under `root` (its `wandb/` folder)."""
    return sorted((pathlib.Path(root) / "wandb").glob("offline-run-*"))
