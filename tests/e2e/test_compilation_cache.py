"""The persistent compilation cache across real processes: what one process compiles, the next one loads.

`grpo-stream eval` builds the smoke config's tiny model and generates with the sampler engine, greedy and sampled
(about 30 programs, the engine's decode among them); run twice on one fresh directory, the second run compiles
nothing and writes no entry, and its completions and scores are the same. Every command that compiles applies the
setting (a bad directory stops each).
"""

import json
import re

import pytest

from tests.e2e.test_up import run_cli

pytestmark = pytest.mark.e2e
FIELD = "runtime.compilation_cache_dir"
SUMMARY = re.compile(r"compilation cache (\S+): (\d+) of (\d+) programs loaded, (\d+) compiled and written")


def _eval(cache_dir, out):
    proc = run_cli("eval", "--config", "configs/tiny_arith_smoke.yaml", "--limit", "8", "--json", str(out),
                   "eval.samples=2", "eval.ks=[1,2]", f"{FIELD}={cache_dir}", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (summary,) = SUMMARY.findall(proc.stdout)
    directory, loaded, lookups, written = summary
    assert directory == str(cache_dir)
    return int(loaded), int(lookups), int(written), json.loads(out.read_text())


def test_second_process_loads_every_program_the_first_compiled(tmp_path):
    cache_dir = tmp_path / "jax-cache"
    loaded, lookups, written, first = _eval(cache_dir, tmp_path / "first.json")
    entries = sorted(p.name for p in cache_dir.iterdir())
    assert loaded == 0 and written == lookups > 0  # a cold cache: every program compiled and written
    assert len(entries) == written and any(name.startswith("jit__decode_chunk-") for name in entries)

    loaded, lookups_again, written, second = _eval(cache_dir, tmp_path / "second.json")
    assert lookups_again == lookups and loaded == lookups and written == 0  # every program read back
    assert sorted(p.name for p in cache_dir.iterdir()) == entries  # and no new entry
    drop = ("date_utc", "seconds")  # (the cold run's seconds are mostly compilation)
    assert {k: v for k, v in second.items() if k not in drop} == {k: v for k, v in first.items() if k not in drop}


@pytest.mark.parametrize("command", ["trainer", "sampler", "colocated", "eval", "up"])
def test_every_compiling_command_refuses_an_unwritable_cache_directory(tmp_path, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    extra = ["weights.transport=local"] if command == "colocated" else []
    proc = run_cli(command, "--config", "configs/tiny_arith_smoke.yaml", f"{FIELD}={blocker}/cache", *extra,
                   timeout=120)
    assert proc.returncode == 1
    assert f"grpo-stream {command}: error: {FIELD}={blocker}/cache: cannot create or write it" in proc.stderr
    assert f"{FIELD}=none" in proc.stderr
    assert not (tmp_path / "runs").exists()
