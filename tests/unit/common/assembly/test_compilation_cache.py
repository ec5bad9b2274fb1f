"""runtime.compilation_cache_dir: where it comes from (config > $GRPO_STREAM_COMPILATION_CACHE_DIR > the user's cache
directory), `none`, bad values, directories that cannot be written, and directories others could have written (their
compiled programs are never loaded: checked in real processes that compile). No JAX in this process: the directory
check runs before JAX loads (and this process's own cache, set up by conftest, is left alone)."""

import json
import logging
import os
import subprocess
import sys

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.process import COMPILATION_CACHE_ENV
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.common.assembly.compilation_cache import CompilationCacheStats, compilation_cache_dir

FIELD = "runtime.compilation_cache_dir"


@pytest.fixture
def no_env(monkeypatch, tmp_path):
    """No cache directory in the environment (conftest sets one for the test run) and a private home."""
    monkeypatch.delenv(COMPILATION_CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_default_is_under_the_users_cache_directory(no_env, monkeypatch):
    assert load_config(None).runtime.compilation_cache_dir == str(no_env / "home/.cache/grpo-stream/jax-compile")
    monkeypatch.setenv("XDG_CACHE_HOME", str(no_env / "xdg"))
    assert load_config(None).runtime.compilation_cache_dir == str(no_env / "xdg/grpo-stream/jax-compile")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # the XDG spec says to ignore a relative value
    assert load_config(None).runtime.compilation_cache_dir == str(no_env / "home/.cache/grpo-stream/jax-compile")


def test_environment_variable_replaces_the_default_and_the_config_wins(no_env, monkeypatch):
    monkeypatch.setenv(COMPILATION_CACHE_ENV, str(no_env / "from-env"))
    assert load_config(None).runtime.compilation_cache_dir == str(no_env / "from-env")
    explicit = load_config(None, [f"{FIELD}={no_env / 'from-config'}"])
    assert explicit.runtime.compilation_cache_dir == str(no_env / "from-config")
    config_file = no_env / "run.yaml"
    config_file.write_text(f"runtime:\n  compilation_cache_dir: {no_env / 'from-file'}\n")
    assert load_config(config_file).runtime.compilation_cache_dir == str(no_env / "from-file")


@pytest.mark.parametrize("value", ["none", "None", "null"])
def test_none_disables_the_cache(no_env, monkeypatch, value):
    monkeypatch.setenv(COMPILATION_CACHE_ENV, str(no_env / "from-env"))
    cfg = load_config(None, [f"{FIELD}={value}"])
    assert cfg.runtime.compilation_cache_dir is None and compilation_cache_dir(cfg) is None
    monkeypatch.setenv(COMPILATION_CACHE_ENV, "none")  # the environment can turn it off too
    assert load_config(None).runtime.compilation_cache_dir is None


def test_home_is_expanded_and_paths_normalised(no_env):
    cfg = load_config(None, [f"{FIELD}=~/caches/../jax"])
    assert cfg.runtime.compilation_cache_dir == str(no_env / "home/jax")


@pytest.mark.parametrize("value", ["relative/dir", "''", "3"])
def test_bad_values_name_the_field(no_env, value):
    with pytest.raises(ConfigError, match=rf"^{FIELD}: .*(absolute directory|valid string)"):
        load_config(None, [f"{FIELD}={value}"])


def test_a_relative_environment_value_is_refused_with_both_sources_named(no_env, monkeypatch):
    monkeypatch.setenv(COMPILATION_CACHE_ENV, "cache")
    with pytest.raises(ConfigError, match=rf"{FIELD}: 'cache' is not an absolute path.*\${COMPILATION_CACHE_ENV}"):
        load_config(None)


def test_the_directory_is_created(no_env):
    target = no_env / "new" / "cache"
    assert compilation_cache_dir(load_config(None, [f"{FIELD}={target}"])) == str(target)
    assert target.is_dir() and not list(target.iterdir())  # the write check leaves nothing behind


def test_an_unwritable_directory_that_was_asked_for_stops_with_the_fix(no_env, monkeypatch):
    blocker = no_env / "a-file"
    blocker.write_text("")
    # (a path under a regular file: unwritable even for root, unlike a chmod'ed directory)
    with pytest.raises(ValueError, match=rf"{FIELD}={blocker}/cache: cannot create or write it .*NotADirectoryError"
                                         rf".*choose a writable directory, or set {FIELD}=none"):
        compilation_cache_dir(load_config(None, [f"{FIELD}={blocker}/cache"]))
    monkeypatch.setenv(COMPILATION_CACHE_ENV, f"{blocker}/env-cache")
    with pytest.raises(ValueError, match=rf"{FIELD}={blocker}/env-cache \(from \${COMPILATION_CACHE_ENV}\)"):
        compilation_cache_dir(load_config(None))


def test_an_unwritable_default_directory_warns_and_runs_without_cache(no_env, monkeypatch, caplog):
    (no_env / "xdg").write_text("")  # $XDG_CACHE_HOME is a file: the default directory cannot be made
    monkeypatch.setenv("XDG_CACHE_HOME", str(no_env / "xdg"))
    cfg = load_config(None)
    with caplog.at_level(logging.WARNING, logger="grpo_stream.runtime"):
        assert compilation_cache_dir(cfg) is None
    assert f"{FIELD}={no_env / 'xdg'}/grpo-stream/jax-compile: cannot create" in caplog.text
    assert "compiling without a persistent cache" in caplog.text


def test_stats_count_jax_cache_events():
    stats = CompilationCacheStats("/c")
    for event in ("compile_requests_use_cache", "cache_hits", "compile_requests_use_cache", "cache_misses",
                  "tasks_using_cache"):
        stats._on_event(f"/jax/compilation_cache/{event}")
    assert (stats.lookups, stats.hits, stats.writes) == (2, 1, 1)
    assert stats.summary() == "compilation cache /c: 1 of 2 programs loaded, 1 compiled and written"
    assert CompilationCacheStats(None).summary() == "compilation cache off"
    assert os.environ[COMPILATION_CACHE_ENV]  # conftest gave the whole test run one directory


def test_a_cache_directory_others_can_write_is_replaced_by_a_private_one(no_env, caplog):
    shared = no_env / "shared-cache"
    shared.mkdir(mode=0o775)
    os.chmod(shared, 0o775)  # whatever the umask
    with caplog.at_level(logging.WARNING, logger="grpo_stream.runtime"):
        used = compilation_cache_dir(load_config(None, [f"{FIELD}={shared}"]))
    assert used != str(shared) and os.stat(used).st_mode & 0o777 == 0o700
    assert f"{FIELD}={shared} is not private to this user: it is writable by group or others (mode 0775)" in caplog.text
    assert f"chmod 700 {shared}" in caplog.text
    created = no_env / "new-cache"
    assert compilation_cache_dir(load_config(None, [f"{FIELD}={created}"])) == str(created)
    assert os.stat(created).st_mode & 0o777 == 0o700  # a directory it creates is private from the start


def _compile(cache, prelude: str = "") -> tuple[dict, str]:
    """A real process that sets up the cache at `cache` and compiles one program: (the cache JAX used, the
    programs loaded from it and written to it), and its log."""
    code = prelude + f"""
import json, logging
logging.basicConfig(level=logging.WARNING)
import jax, jax.numpy as jnp
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.assembly.compilation_cache import enable_compilation_cache
stats = enable_compilation_cache(load_config(None, ["{FIELD}={cache}"]))
jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
print(json.dumps({{"dir": jax.config.jax_compilation_cache_dir, "hits": stats.hits, "writes": stats.writes}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_compiled_programs_in_a_cache_others_could_write_are_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    first, _ = _compile(cache)
    assert first["dir"] == str(cache) and first["hits"] == 0 and first["writes"] >= 1, first
    os.chmod(cache, 0o770)  # from now on anyone in the group could have replaced the program with their own
    shared, log = _compile(cache)
    assert shared["hits"] == 0 and shared["dir"] != str(cache), shared
    assert "is not private to this user" in log
    # another user's directory: the process believes it runs as some other uid
    os.chmod(cache, 0o700)
    foreign, log = _compile(cache, prelude="import os; _uid = os.getuid() + 4242; os.getuid = lambda: _uid\n")
    assert foreign["hits"] == 0 and foreign["dir"] != str(cache) and "is owned by uid" in log
    mine, _ = _compile(cache)  # the control: private again, the programs compiled at first are loaded
    assert mine == {"dir": str(cache), "hits": first["writes"], "writes": 0}
