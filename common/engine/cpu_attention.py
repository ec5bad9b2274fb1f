"""The continuous engine's ragged decode attention on CPU (ragged_attention.cc, an XLA FFI custom call).

On CPU a decode step's attention is bound by reading the KV cache, and XLA's
dense attention reads every slot's whole window (on one thread): in a
long-tailed request set most rows are far shorter than the longest live one.
The kernel reads each row's own positions only, and spreads rows over XLA's
intra-op threads.

It is built on first use with the system's C++ compiler (`c++`, or $CXX)
against the XLA FFI headers that jaxlib ships, into a per-user cache keyed by
the source, jaxlib's version and the compiler's target, so one build serves
every process of a run. Where no compiler is found or the build fails, the
engine keeps XLA's dense attention and says so once in the log
(`generation.decode_attention: dense` chooses that path on purpose). It serves
only single-device float32 CPU programs with one query token per row; GPUs
and TPUs use the dense path (an accelerator's ragged paged-attention kernel
would go behind the same switch).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("ragged_attention.cc")
TARGET = "grpo_stream_ragged_attention"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "grpo-stream" / "kernels"


def _build(compiler: str) -> pathlib.Path:
    """The shared library, compiled unless a build of this source for this jaxlib and machine is cached."""
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}"]
    machine = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True,
                             text=True).stdout  # -march=native's resolved target: a build is per CPU model
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, compiler, *flags, machine])
                         .encode()).hexdigest()[:16]
    library = _cache_dir() / f"ragged_attention-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = pathlib.Path(tmp) / library.name
        proc = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(built, library)  # atomic: processes building at once each install a whole file
    return library


def available() -> bool:
    """Whether the kernel is built and registered (builds it on the first call)."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if (compiler := _compiler()) is None:
            log.warning("no C++ compiler found (set CXX): the CPU decode attention stays XLA's dense form, which "
                        "reads every slot's whole window")
        else:
            try:
                library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.GrpoStreamRaggedAttention),
                                            platform="cpu")
                ok = True
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("the ragged CPU attention kernel could not be built (%s): the CPU decode attention "
                            "stays XLA's dense form", exc)
        _state["ok"] = ok
        return ok


def ragged_attention(q: jax.Array, keys: jax.Array, values: jax.Array, lengths: jax.Array,
                     softcap: float | None) -> jax.Array:
    """Attention of q [B, KV, G, D] (scaled) over the first lengths[b] positions of keys [B, KV, D, W] and values
    [B, KV, W, D]; returns [B, KV, G, D]. Only on CPU, in float32, where `available()` says yes."""
    if not available():
        raise RuntimeError("the ragged CPU attention kernel is not available (see the log); use the dense path")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, keys, values, lengths.astype(jnp.int32), softcap=np.float32(softcap or 0.0))
