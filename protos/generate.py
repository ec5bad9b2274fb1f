"""Regenerate the Python code for every .proto in this folder.

    python -m grpo_stream.protos.generate          # write protos/*_pb2*.py(i)
    python -m grpo_stream.protos.generate --check  # exit 1 if the committed code is stale

Imports in the generated code are absolute and use the installed name (`from grpo_stream.protos import
rollout_pb2`): protoc runs on a copy of the .proto files laid out as grpo_stream/protos/.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (grpcio-tools) into `out_root`/grpo_stream/protos; return the files written."""
    from grpc_tools import protoc  # only needed by developers, not at run time

    src = out_root / "src"
    (src / "grpo_stream" / "protos").mkdir(parents=True)
    for proto in PROTO_DIR.glob("*.proto"):
        shutil.copyfile(proto, src / "grpo_stream" / "protos" / proto.name)
    protos = sorted(p.relative_to(src).as_posix() for p in (src / "grpo_stream" / "protos").glob("*.proto"))
    out = out_root / "grpo_stream" / "protos"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{src}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    return sorted(out.glob("*_pb2*.py*"))


def stale_files(written: list[pathlib.Path], committed_dir: pathlib.Path) -> list[str]:
    """Names of generated files that differ from, are missing in, or are extra in `committed_dir`."""
    stale = [p.name for p in written
             if not (committed_dir / p.name).exists() or not filecmp.cmp(p, committed_dir / p.name, shallow=False)]
    committed = {p.name for p in committed_dir.glob("*_pb2*.py*")}
    return stale + sorted(committed - {p.name for p in written})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed code instead of writing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        written = generate(pathlib.Path(tmp))
        if args.check:
            stale = stale_files(written, PROTO_DIR)
            if stale:
                print(f"stale generated code: {', '.join(stale)}"
                      "; run `python -m grpo_stream.protos.generate`", file=sys.stderr)
                return 1
            print("generated code is up to date")
        else:
            for path in written:
                shutil.copyfile(path, PROTO_DIR / path.name)
            print("wrote " + ", ".join(p.name for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
