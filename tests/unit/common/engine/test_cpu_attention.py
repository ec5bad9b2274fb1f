"""The ragged CPU decode attention kernel: the dense attention's numbers, read only up to each row's length; the
engine uses it where it can and falls back to the dense form, saying so, where it cannot build."""

import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.engine import cpu_attention, decode
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.runtime.private_dir import make_private_dir

pytestmark = pytest.mark.skipif(cpu_attention._compiler() is None, reason="no C++ compiler to build the kernel")
NO_EOS = -1


def _dense(q, keys, values, lengths, softcap):
    """decode._attention's dense form on the same inputs (t = 1), the new key/value already in the caches."""
    b, kv, g, d = q.shape
    valid = (jnp.arange(keys.shape[3])[None] < lengths[:, None])[:, None, :]
    at = lengths - 1
    k_new = jnp.take_along_axis(keys, at[:, None, None, None], axis=3)[..., 0][:, None]
    v_new = jnp.take_along_axis(values, at[:, None, None, None], axis=2)[:, :, 0][:, None]
    out, _, _ = decode._attention(q.reshape(b, 1, kv * g, d), k_new, v_new, keys, values, at, valid, kv, softcap,
                                  scale=1.0)
    return out.reshape(b, kv, g, d)


@pytest.mark.parametrize("group,head_dim,softcap", [(4, 64, None), (1, 16, None), (3, 32, 30.0), (8, 128, None),
                                                    (5, 64, 50.0), (2, 8, None), (4, 28, None)])
def test_kernel_equals_dense_attention_and_reads_nothing_past_a_rows_length(group, head_dim, softcap):
    rng = np.random.default_rng(group * head_dim)
    rows, kv, window = 9, 2, 128
    lengths = np.array([1, 17, 64, 100, window, 33, 2, 127, 80], np.int32)
    q = (rng.standard_normal((rows, kv, group, head_dim)) * head_dim ** -0.5).astype(np.float32)  # scaled, as used
    keys = rng.standard_normal((rows, kv, head_dim, window)).astype(np.float32)
    values = rng.standard_normal((rows, kv, window, head_dim)).astype(np.float32)
    want = _dense(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(lengths), softcap)
    for r, n in enumerate(lengths):  # what lies past a row's length must not matter: poison it
        keys[r, :, :, n:] = np.nan
        values[r, :, n:] = np.nan
    assert cpu_attention.available()
    got = jax.jit(cpu_attention.ragged_attention, static_argnums=4)(q, keys, values, lengths, softcap)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)  # float32 sums reordered


def test_kernel_refuses_shapes_that_disagree():
    q = jnp.zeros((2, 2, 4, 64))
    keys, values = jnp.zeros((2, 2, 64, 128)), jnp.zeros((2, 2, 64, 64))  # values' window is not keys'
    with pytest.raises(Exception, match="shapes disagree"):
        jax.block_until_ready(cpu_attention.ragged_attention(q, keys, values, jnp.ones((2,), jnp.int32), None))


def test_engine_decodes_the_same_with_the_kernel_as_with_dense_attention(tiny_parts):
    """Same tokens (greedy) and logprobs to float rounding, on a request set with refills, compaction and windows
    that grow; the kernel's programs are recorded as ragged."""
    cfg, task, tok, model = tiny_parts
    prompts = [tok.encode(task.train_problem(i).prompt) for i in range(6) for _ in range(3)]
    budgets = [70, 5, 12, 3, 40, 9] * 3
    outs, stats = {}, {}
    for ragged in (True, False):
        engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 80, 1.0, slots=8,
                                  chunk_steps=4, ragged_attention=ragged)
        outs[ragged] = engine.generate(model.params, prompts, jax.random.key(0), greedy=True, max_new_tokens=budgets)
        assert {p[2] for p in engine.programs if p[0] == "decode"} == {ragged}
        stats[ragged] = engine.stats
    np.testing.assert_array_equal(outs[True].tokens, outs[False].tokens)
    np.testing.assert_allclose(outs[True].logprobs, outs[False].logprobs, atol=1e-5)
    # dense attention reads every slot's window; ragged reads each live row's own positions (the step sampling
    # token j of a prompt of P tokens reads P + j + 1) and one position of an idle slot
    assert stats[False]["attention_positions_read"] == stats[False]["cache_positions_read"]
    own = sum(sum(len(p) + j + 1 for j in range(n)) for p, n in zip(prompts, budgets))
    idle = stats[True]["slot_steps"] - sum(budgets)
    assert stats[True]["attention_positions_read"] == own + idle
    assert own + idle < 0.6 * stats[True]["cache_positions_read"]


def _probe(env: dict, cache: pathlib.Path, prelude: str = "") -> subprocess.CompletedProcess:
    code = (prelude + "import logging; logging.basicConfig(level=logging.INFO)\n"
            "from grpo_stream.common.engine import cpu_attention\n"
            "print('available', cpu_attention.available())\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache), **env})


@pytest.fixture(scope="module")
def first_build(tmp_path_factory) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    """A probe's build of the kernel into a fresh cache, made once for the file: the cache tests check it, and the
    planting tests take its file name (the key for this CPU and jaxlib) instead of each building the kernel again."""
    cache = tmp_path_factory.mktemp("first-build")
    return _probe({}, cache), cache


def test_the_build_is_cached_and_a_failed_build_falls_back_to_dense_attention(first_build, tmp_path):
    first, cache = first_build
    assert "available True" in first.stdout, first.stderr
    built = list((cache / "grpo-stream" / "kernels").glob("ragged_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert "available True" in _probe({}, cache).stdout and built[0].stat().st_mtime_ns == stamp  # reused
    broken = _probe({"CXX": "/bin/false"}, tmp_path / "other")
    assert "available False" in broken.stdout
    assert "could not be built" in broken.stderr and "XLA's dense form" in broken.stderr


def test_the_config_chooses_the_attention(tiny_parts):
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.engine import continuous
    from tests.conftest import CONFIGS

    _, _, tok, model = tiny_parts
    for choice, ragged in (("auto", True), ("dense", False)):
        cfg = load_config(CONFIGS / "tiny_arith.yaml", [f"generation.decode_attention={choice}"])
        assert continuous.build(cfg, model, tok).ragged_attention is ragged
    with pytest.raises(Exception, match="decode_attention"):
        load_config(CONFIGS / "tiny_arith.yaml", ["generation.decode_attention=paged"])


# A library that announces being loaded: its constructor runs at dlopen, before any symbol is looked up.
PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
  if (f) { fputs("planted code ran", f); fclose(f); }
}
void GrpoStreamRaggedAttention(void) {}
"""


def _plant(tmp_path: pathlib.Path, first_build) -> tuple[pathlib.Path, dict]:
    """Put a planted library in the cache under tmp_path (private, as the kernel would make it) where the genuine
    kernel's build would be (its file name, the key for this CPU and jaxlib, is first_build's); returns the cached
    path and the environment that names the marker."""
    first, cache = first_build
    assert "available True" in first.stdout, first.stderr
    [genuine] = (cache / "grpo-stream" / "kernels").glob("ragged_attention-*.so")
    kernels = tmp_path / "grpo-stream" / "kernels"
    assert make_private_dir(kernels) is None
    built = kernels / genuine.name
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    subprocess.run([cpu_attention._compiler(), "-x", "c", "-shared", "-fPIC", str(source), "-o", str(built)],
                   check=True)
    return built, {"PLANTED_MARKER": str(tmp_path / "marker")}


def test_a_library_planted_in_a_kernel_cache_others_can_write_is_not_loaded(tmp_path, first_build):
    built, env = _plant(tmp_path, first_build)
    os.chmod(built.parent, 0o770)  # group-writable: anyone in the group could have put it there
    probe = _probe(env, tmp_path)
    assert not (tmp_path / "marker").exists(), "the planted library was loaded"
    assert "available True" in probe.stdout, probe.stderr  # the kernel is built privately instead
    assert "writable by group or others (mode 0770)" in probe.stderr
    assert "private temporary directory" in probe.stderr and f"chmod 700 {built.parent}" in probe.stderr
    os.chmod(built.parent, 0o700)  # the control: in a private cache this user's own library is what is loaded
    assert "available True" in _probe(env, tmp_path).stdout and (tmp_path / "marker").exists()


def test_a_library_planted_in_a_kernel_cache_of_another_owner_is_not_loaded(tmp_path, first_build):
    built, env = _plant(tmp_path, first_build)
    # the cache's owner is this user; the probe believes it runs as another one (any other uid)
    probe = _probe(env, tmp_path, prelude="import os; _uid = os.getuid() + 4242; os.getuid = lambda: _uid\n")
    assert not (tmp_path / "marker").exists(), "the planted library was loaded"
    assert f"is owned by uid {built.parent.stat().st_uid}, not by this user" in probe.stderr


@pytest.mark.parametrize("compiler,cpu", [("g++", "-march="), ("clang++", "-target-cpu=")])
def test_the_cache_key_holds_the_cpus_features_for_gcc_and_clang(compiler, cpu):
    """A home shared by machines of different CPUs must not serve one a build for another (SIGILL): the key holds
    -march=native's expansion, which gcc and clang both print with -### (gcc's -Q --help=target has no clang form,
    so with clang the key had no CPU part), and /proc/cpuinfo's flags."""
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed")
    features = cpu_attention._cpu_features(compiler)
    target, cpuinfo = features.split("\n")
    assert cpu in target and ("avx" in target or "neon" in target or "sse" in target), target
    assert cpuinfo or not os.path.exists("/proc/cpuinfo")
    assert cpu_attention._cpu_features(compiler) == features  # nothing that differs between calls (temporary files)
