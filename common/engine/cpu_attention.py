"""The continuous engine's ragged decode attention on CPU (ragged_attention.cc, an XLA FFI custom call).

On CPU a decode step's attention is bound by reading the KV cache, and XLA's
dense attention reads every slot's whole window (on one thread): in a
long-tailed request set most rows are far shorter than the longest live one.
The kernel reads each row's own positions only, and spreads rows over XLA's
intra-op threads.

It is built on first use with the system's C++ compiler (`c++`, or $CXX)
against the XLA FFI headers that jaxlib ships, into a per-user cache keyed by
the source, jaxlib's version and the CPU's features (what the compiler makes
of -march=native, for gcc and clang alike, and /proc/cpuinfo's flags), so one
build serves every process of a run and a home shared by machines of other CPU
models never serves one a build for another (SIGILL). The library is loaded as
code: the cache is used only when it is this user's own and no one else can
write it (common/runtime/private_dir.py), and the file is opened once, checked,
and loaded through that same open file, so it cannot be swapped in between.
Otherwise the kernel is built into a private temporary directory, with a
warning that names the fix. Where no compiler is found or the build fails, the
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
import stat
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from grpo_stream.common.runtime.private_dir import fix_hint, make_private_dir

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


def _cpu_features(compiler: str) -> str:
    """What -march=native means here: the target flags the compiler driver expands it to (`-###` prints them: gcc's
    -march=<cpu> -m<feature> list, clang's -target-cpu <cpu> -target-feature +<feature> list; gcc's `-Q
    --help=target` has no clang form), and the kernel's CPU flags where /proc/cpuinfo exists."""
    proc = subprocess.run([compiler, "-march=native", "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull],
                          capture_output=True, text=True, timeout=120)
    words = proc.stderr.replace('"', " ").replace("'", " ").split()
    pairs = ("-target-cpu", "-target-feature", "-tune-cpu")
    target = [w if w.startswith("-m") else f"{words[i - 1]}={w}" for i, w in enumerate(words)
              if w.startswith("-m") or (i and words[i - 1] in pairs)]
    cpuinfo = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return " ".join(target) + "\n" + " ".join(sorted(cpuinfo.split(":", 1)[-1].split()))


def _build(compiler: str, directory: pathlib.Path) -> pathlib.Path:
    """The shared library in `directory`, compiled unless a build of this source for this jaxlib and CPU is there."""
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, compiler, *flags,
                                    _cpu_features(compiler)]).encode()).hexdigest()[:16]
    library = directory / f"ragged_attention-{key}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = pathlib.Path(tmp) / library.name
        proc = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.chmod(built, 0o700)  # whatever the umask: no one else may write what this user loads
        os.replace(built, library)  # atomic: processes building at once each install a whole file
    return library


def _load_private(library: pathlib.Path) -> ctypes.CDLL:
    """dlopen `library` (in a directory found private) only if it is a regular file of this user, through the very
    file checked (an open descriptor), so a file swapped in after the check is never the one loaded."""
    fd = os.open(library, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise OSError(f"{library}: not a regular file of this user; not loaded")
        return ctypes.CDLL(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(library))
    finally:
        os.close(fd)


def _built_library(compiler: str) -> ctypes.CDLL:
    """The kernel's library, from the per-user cache when that is private, else built in a temporary directory."""
    cache = _cache_dir()
    try:
        reason = make_private_dir(cache)
    except OSError as exc:
        reason = f"cannot create it ({exc.strerror})"
    if reason is None:
        return _load_private(_build(compiler, cache))
    log.warning("kernel cache %s is not private to this user: %s. Building the CPU attention kernel in a private "
                "temporary directory instead (each process builds it again); %s", cache, reason, fix_hint(cache))
    with tempfile.TemporaryDirectory(prefix="grpo-stream-kernel-") as tmp:  # 0700, this user's
        return _load_private(_build(compiler, pathlib.Path(tmp)))  # a loaded library outlives its file


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
                library = _built_library(compiler)
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
