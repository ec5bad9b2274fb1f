"""A LoRA run's frozen base, written once per run to `lora-base/` beside the step checkpoints (which hold the adapters
and their optimizer state only), and read back on resume, checked against the layout and digest saved with it."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from grpo_stream.trainer_service.checkpoints.digest import tree_digest, tree_layout
from grpo_stream.trainer_service.checkpoints.errors import CheckpointMismatch, base_save_failed, base_unreadable

log = logging.getLogger(__name__)
BASE_DIR = "lora-base"  # the frozen base of a LoRA run, written once


def save_base(directory: epath.Path, frozen: Any, verify: bool, settings: dict | None = None) -> None:
    """Write the frozen base weights (LoRA), synchronously, replacing any earlier one (a run that starts afresh
    in this directory may have warm-started another base; a resumed run reads it and never writes it). The step
    checkpoints that follow hold the adapters only. `settings`: the run's model.lora (rank, alpha, targets), which
    its adapters mean something under only (`check_settings`)."""
    path = directory / BASE_DIR
    (path / "record.json").unlink(missing_ok=True)  # from here until the new record: no base
    started = time.time()
    record = {"layout": tree_layout(frozen), "saved_unix": started}
    if settings is not None:
        record["lora"] = settings
    if verify:
        record["digest"] = tree_digest(frozen)
    try:
        with ocp.StandardCheckpointer() as checkpointer:  # closed (its threads ended) on a failure too
            checkpointer.save(path / "arrays", frozen, force=True)
            checkpointer.wait_until_finished()
    except Exception as exc:  # noqa: BLE001 - a full disk, a storage that refused the write: Orbax's bare error
        raise base_save_failed(directory, path, exc) from exc
    # the record last: a base directory without it is an interrupted save, written again by the next trainer
    tmp = path / "record.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(path / "record.json")
    log.info("LoRA: frozen base written to %s (%.1f s)", path, time.time() - started)


def check_settings(directory: epath.Path, settings: dict) -> None:
    """Raises CheckpointMismatch naming the field when the run's model.lora `settings` differ from those its frozen
    base was saved with: another alpha leaves every shape alike, so the adapters would load and silently act at
    another scale (W + alpha / rank A B), and another rank or targets would only be told as a layout change. A base
    without a record, or saved without its settings, is left to `restore_base`."""
    try:
        saved = json.loads((directory / BASE_DIR / "record.json").read_text()).get("lora")
    except Exception:  # noqa: BLE001 - missing or unreadable: restore_base says so, with the fix
        return
    if not isinstance(saved, dict):
        return
    for field, value in settings.items():
        if field in saved and saved[field] != value:
            raise CheckpointMismatch(
                f"checkpoint.dir {directory}: its LoRA adapters were trained with model.lora.{field}="
                f"{saved[field]!r}, and this config has model.lora.{field}={value!r}; set model.lora.{field}="
                f"{saved[field]!r} to resume, or start a new run with another checkpoint.dir")


def restore_base(directory: epath.Path, frozen_like: Any, verify: bool) -> Any:
    """The frozen base `save_base` wrote, placed like `frozen_like`; raises CheckpointMismatch when it is
    missing or holds another model (the step checkpoints hold adapters only, so a run cannot resume without it)."""
    path = directory / BASE_DIR
    where = f"checkpoint.dir {directory}: the frozen base in {path}"
    if not (path / "record.json").exists():  # the step checkpoints hold LoRA adapters only: useless without it
        raise CheckpointMismatch(f"{where}, which its LoRA adapters need, is missing or was cut off while being "
                                 "written; restore that directory, or start a new run with another checkpoint.dir")
    try:
        record = json.loads((path / "record.json").read_text())
        if not isinstance(record, dict):
            raise ValueError(f"record.json holds a JSON {type(record).__name__}, not an object")
    except Exception as exc:  # noqa: BLE001 - cut off by a power loss after its rename, or edited
        raise base_unreadable(directory, path, exc) from exc
    if record.get("layout") != tree_layout(frozen_like):
        raise CheckpointMismatch(f"{where} is of another model (shapes or dtypes differ from model.path's); "
                                 "restore the run's config or start a new run with another checkpoint.dir")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            frozen = checkpointer.restore(path / "arrays", jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                                        frozen_like))
    except Exception as exc:  # noqa: BLE001 - told apart there: the storage not answering, or a damaged base
        raise base_unreadable(directory, path, exc) from exc
    if verify and "digest" in record and tree_digest(frozen) != record["digest"]:
        raise CheckpointMismatch(f"{where} does not match the SHA-256 saved with it (damaged storage); restore "
                                 "it from a copy, or start a new run with another checkpoint.dir")
    return frozen
