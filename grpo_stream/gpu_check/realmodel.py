"""gpu-check's real-model phase (`scripts/gpu-check.sh --realmodel`): SmolLM2-135M-Instruct, a real pretrained model,
on GSM8K under `up` on the GPU, with held-out accuracy before and after and each process's tokens/s.

The GPU machine has no network and one call carries at most 64 MiB, less than the model's GGUF (98 MB; the
converted float32 directory is 538 MB). So the GGUF travels in parts over consecutive calls and is joined and
converted there (`grpo-stream fixture smollm2 --source`, which checks the pinned sha256 of the joined file):

    python -m grpo_stream.gpu_check.realmodel split            # here: .realmodel/smollm2.gguf.part-0, part-1
    run(command="true", carry=[".realmodel/smollm2.gguf.part-0"])       # each part stays there while the
    run(command="true", carry=[".realmodel/smollm2.gguf.part-1"])       # machine is held (ignored outputs are kept)
    run(command="bash scripts/gpu-check.sh --realmodel --out $OUT", carry=[".whl"], timeout_s=600)

(`.whl`, from scripts/gpu-wheels.sh, holds the wheels the image lacks, gguf among them.) Without the parts the
phase is recorded as skipped, saying how to bring them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARTS = ROOT / ".realmodel"
PART_BYTES = 52 << 20  # each part well under one call's 64 MiB
CONFIG = "configs/smollm2_gsm8k.yaml"


def split(out: pathlib.Path = PARTS, part_bytes: int = PART_BYTES) -> list[pathlib.Path]:
    """The pinned SmolLM2 GGUF (from where `grpo-stream fixture` finds it) cut into parts in `out`."""
    from grpo_stream.fixture import FIXTURES, gguf_file

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("smollm2.gguf.part-*"):
        old.unlink()
    parts = []
    with tempfile.TemporaryDirectory() as scratch:
        gguf, _ = gguf_file(FIXTURES["smollm2"], None, pathlib.Path(scratch), lambda line: print(line, file=sys.stderr))
        with open(gguf, "rb") as src:
            while block := src.read(part_bytes):
                parts.append(out / f"smollm2.gguf.part-{len(parts)}")
                parts[-1].write_bytes(block)
    return parts


def join(parts_dir: pathlib.Path, into: pathlib.Path) -> pathlib.Path | None:
    """The parts joined in order (None when there are none); the fixture checks the whole file's sha256. A gap in
    the numbers (a part carried by a call whose machine was given back before the next call) is refused by name."""
    parts = sorted(parts_dir.glob("smollm2.gguf.part-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    if not parts:
        return None
    have = [int(p.name.rsplit("-", 1)[1]) for p in parts]
    if missing := sorted(set(range(max(have) + 1)) - set(have)):
        raise ValueError(f"{parts_dir.name}/smollm2.gguf.part-{missing[0]} is not there (parts {have} are): the "
                         "machine was given back between the calls that carried them; carry every part again, in "
                         "calls back to back")
    with open(into, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
    return into


def up_args(model: pathlib.Path, gsm8k: pathlib.Path, steps: int, dry_run: bool) -> list[str]:
    """The shipped GPU config, pointed at the converted model and GSM8K, for `steps` steps (dry: tiny sizes)."""
    args = ["--config", CONFIG, f"model.path={model}", f"task.dataset.source={gsm8k}", f"trainer.steps={steps}",
            f"trainer.optimizer.warmup_steps={max(1, steps // 10)}", "checkpoint.every=1000000",
            "checkpoint.verify=false", "trainer.final_wait_s=30", "eval.num_problems=256", "eval.batch_size=128"]
    if dry_run:
        args += ["generation.max_prompt_tokens=192", "generation.max_new_tokens=8", "trainer.groups_per_step=2",
                 "sampler.rows_in_flight=16", "buffer.max_groups=8", "eval.num_problems=8", "eval.batch_size=8",
                 "task.dataset.limit=64"]
    return args


def realmodel_phase(runner, gsm8k: pathlib.Path) -> dict:
    """Join the carried parts, convert them, run `up` on GSM8K; the run's figures and accuracy before/after."""
    try:
        joined = join(PARTS, runner.work / "smollm2.gguf")
    except ValueError as error:
        return {"status": "failed", "reason": str(error)}
    if joined is None:
        return {"status": "skipped", "reason": f"no {PARTS.name}/smollm2.gguf.part-* carried: run `python -m "
                "grpo_stream.gpu_check.realmodel split` here and carry the parts (grpo_stream/gpu_check/realmodel.py)"}
    model = runner.work / "models" / "smollm2-135m-instruct"
    start = time.monotonic()
    built = runner.run([sys.executable, "-m", "grpo_stream", "fixture", "smollm2", "--source", str(joined), "--out",
                        str(model)], runner.out / "realmodel-fixture.log", runner.end)
    joined.unlink()
    if built["exit_code"] != 0:
        return {"status": "failed", "fixture": built}
    marker = json.loads((model / "fixture.json").read_text())
    fixture = {"seconds": round(time.monotonic() - start, 1), "convert_seconds": marker["seconds"],
               "peak_rss_mib": marker["peak_rss_mib"]}
    steps = runner.mode.steps
    result = runner.up("realmodel", up_args(model, gsm8k, steps, runner.dry_run), steps)
    summary = runner._summary("realmodel")
    before, after = ((summary.get(k) or {}).get("accuracy") for k in ("eval_before", "eval_after"))
    result.update(fixture=fixture, accuracy_before=before, accuracy_after=after,
                  gain_points=None if before is None or after is None else round(100 * (after - before), 2))
    shutil.rmtree(model, ignore_errors=True)
    return result


def run_realmodel(runner) -> int:
    """The environment, then the real-model phase; exit 0 when it ran and every figure is there."""
    from grpo_stream.gpu_check.model import gsm8k_source

    runner.record("environment", runner.environment())
    gsm8k, where = gsm8k_source(None, runner.work)
    runner.doc["gsm8k"] = {"path": str(gsm8k), "from": where}
    if reason := runner.no_gpu():  # SmolLM2 on the CPU would spend the phase's cap and measure nothing
        runner.record("realmodel", {"status": "skipped", "reason": reason})
    else:
        runner.phase("realmodel", lambda: realmodel_phase(runner, gsm8k))
    phase = runner.doc["phases"]["realmodel"]
    problems = [f"realmodel: {phase.get('status')}"] if phase.get("status") != "ok" else []
    problems += [f"realmodel: no {k}" for k in ("accuracy_before", "accuracy_after") if phase.get(k) is None]
    runner.doc["passed"], runner.doc["problems"] = not problems, problems
    runner.record("realmodel", phase)
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_stream.gpu_check.realmodel", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["split"], help="split: cut the pinned GGUF into parts a call can carry")
    parser.add_argument("--out", type=pathlib.Path, default=PARTS, help="where the parts go (default .realmodel)")
    args = parser.parse_args(argv)
    for part in split(args.out):
        print(f"{part} ({part.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
