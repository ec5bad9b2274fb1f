"""RUN_DIR/config.yaml: the resolved config `up` runs, and what changed since the last `up` in the same directory.

Running `up` again on a run directory resumes that run (its buffer, its checkpoints) with whatever config it is given
now. Changing some settings on purpose is part of resuming (a raised trainer.steps trains a finished run further),
but a resume with the wrong --config or a forgotten override would otherwise go on silently, and the record of what
the run was trained with would be overwritten. So `record_config` compares the new resolved config with the record the
last `up` left, names every setting that differs (old -> new) on stderr, and keeps the earlier record as
config.yaml.1 (older ones as .2 ... .CONFIG_KEEP). Settings `up` itself chooses afresh at each start (the embedded
Redis's URL, the ports it picked) are no change of the run and are not compared.

`snapshot_config` copies the config file `up` was given to RUN_DIR/config.source.yaml (private: it may hold secrets),
and every process `up` starts, and restarts, reads that copy: a file at --config edited, moved or deleted while the
run goes on (the next experiment prepared in it) must not reach one restarted process alone, nor stop the run at a
restart with a config error.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, Callable, Iterable

import yaml

from grpo_stream.common.config.base import dotted_settings
from grpo_stream.common.config.yaml_text import read_yaml
from grpo_stream.common.runtime.files import write_atomic
from grpo_stream.up.relay import rotate, say_now

CONFIG_KEEP = 4  # earlier records kept: config.yaml.1 .. config.yaml.4
SHOWN = 20  # differences named on the console; the rest are counted (the files hold them all)
SOURCE_FILE = "config.source.yaml"  # in RUN_DIR: the copy of --config that `up`'s processes read


def config_changes(previous: dict, current: dict, ignore: Iterable[str] = ()) -> list[str]:
    """'key: old -> new' for every dotted setting that differs between two resolved configs, in key order;
    `ignore`: the dotted keys (and what lies below them) not to compare."""
    skip = tuple(ignore)
    old, new = dotted_settings(previous), dotted_settings(current)
    missing = object()
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if any(key == s or key.startswith(f"{s}.") for s in skip):
            continue
        a, b = old.get(key, missing), new.get(key, missing)
        if a != b:
            lines.append(f"{key}: {_short(a, missing)} -> {_short(b, missing)}")
    return lines


def _short(value: Any, missing: object) -> str:
    if value is missing:
        return "(not set)"
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else f"{text[:57]}..."


def record_config(path: pathlib.Path, text: str, ignore: Iterable[str] = (),
                  say: Callable[[str], None] = lambda line: say_now(line, sys.stderr)) -> list[str]:
    """Write `text` (the resolved config as YAML, a comment first) to `path` whole; when the record an earlier `up`
    left there differs (or cannot be read), say so naming each difference and keep it as path.1. Returns the
    differences."""
    try:
        earlier = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        earlier = None
    changes: list[str] = []
    if earlier is not None:
        try:
            previous = read_yaml(earlier)
            if not isinstance(previous, dict):
                raise ValueError("not a mapping")
        except (yaml.YAMLError, ValueError, RecursionError) as exc:  # e.g. cut short by a kill mid-write
            say(f"[up] warning: {path} (the config of the last `up` here) cannot be read ({type(exc).__name__}), so "
                f"this resume is not compared with it; it is kept as {path.name}.1")
            rotate(path, CONFIG_KEEP)
        else:
            changes = config_changes(previous, read_yaml(text), ignore)
    if changes:
        more = f"; and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
        say(f"[up] warning: resuming {path.parent} with a config that differs from its last run's in "
            f"{len(changes)} setting(s): {'; '.join(changes[:SHOWN])}{more}. The earlier config is kept as "
            f"{path.name}.1 (diff it against {path.name}); if this was not meant, stop now (Ctrl-C) and start again "
            "with the run's config, or use another --run-dir")
        rotate(path, CONFIG_KEEP)
    write_atomic(path, text)  # whole or not at all: a kill mid-write must not leave half a record to compare with
    return changes


def snapshot_config(config_path: pathlib.Path | None, run_dir: pathlib.Path) -> pathlib.Path | None:
    """RUN_DIR/config.source.yaml: the bytes of `config_path` as they are now, written whole and readable by this
    user only (module doc); None without a config file."""
    if config_path is None:
        return None
    target = run_dir / SOURCE_FILE
    write_atomic(target, pathlib.Path(config_path).read_bytes(), private=True)
    return target
