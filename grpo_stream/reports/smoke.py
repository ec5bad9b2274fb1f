"""The result of a smoke run (scripts/tpu-vllm-smoke.sh): one JSON document a user on hardware we do not have can
send back, saying what ran, on what, and whether the loop held.

    python -m grpo_stream.reports.smoke RUN_DIR [--python PY ...] [--out F]

RUN_DIR is an `up` run directory. Each --python (the trainer's and the sampler's interpreters) is asked which jax,
vLLM and tpu-inference it has and which devices it sees. The format (`"format": "grpo-stream-smoke/1"`):

  passed         every check below ok
  checks         name -> {value, want, ok}: the trainer finished its steps; the sampler installed the final
                 version; no group was refused as invalid; the sampler's behaviour logprobs agree with the
                 trainer's recomputation at version lag 0 (mean absolute difference, where any token was compared)
  run            engine, weight_updates, steps, groups trained / generated / wasted share, mixed-version groups,
                 versions published and installed, weight installs logged, seconds, the agreement figures, held-out
                 accuracy before and after, and whether the final greedy completions equal the trainer's (reported,
                 not required: bfloat16 kernels may break ties differently)
  damaged        the run's JSON files that are not JSON objects (cut short by a kill): their checks fail
  environments   per interpreter: python, platform, jax, vllm, tpu_inference versions, device kind and count
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import yaml

from grpo_stream.reports.run_report import json_object

FORMAT = "grpo-stream-smoke/1"
AGREEMENT_MEAN_ABS = 0.05  # bfloat16 engines: a few hundredths of a nat on average; a wrong weight map gives whole nats
PROBE = """
import importlib, json, platform, sys
out = {"python": sys.version.split()[0], "platform": platform.platform()}
for name in ("jax", "vllm", "tpu_inference"):
    try:
        out[name] = getattr(importlib.import_module(name), "__version__", "unknown")
    except Exception:
        out[name] = None
try:
    import jax
    devices = jax.devices()
    out["device_kind"], out["device_count"] = devices[0].device_kind, len(devices)
except Exception as exc:
    out["device_error"] = repr(exc)[:300]
print(json.dumps(out))
"""


def probe(python: str) -> dict:
    """What interpreter `python` runs with (versions, devices), or the error that stopped it."""
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"interpreter": python, "error": repr(exc)[:300]}
    if proc.returncode != 0:
        return {"interpreter": python, "error": proc.stderr.strip()[-300:]}
    try:
        return {"interpreter": python, **json.loads(proc.stdout.strip().splitlines()[-1])}
    except (ValueError, IndexError, TypeError):  # it printed no JSON object last
        return {"interpreter": python, "error": f"no answer on stdout: {proc.stdout.strip()[-300:]!r}"}


def _check(value, want: str, ok: bool) -> dict:
    return {"value": value, "want": want, "ok": bool(ok)}


def read_config(run_dir: pathlib.Path) -> dict:
    """RUN_DIR/config.yaml (what `up` saved), with the fields the result reads; a ValueError names what is wrong."""
    path = run_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(errors="replace"))
        cfg["trainer"]["steps"], cfg["sampler"]["engine"], cfg["sampler"]["weight_updates"], cfg["model"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not the config `up` saves for a run ({type(exc).__name__}: {exc}); give an `up` "
                         "run directory") from None
    return cfg


def read_json(path: pathlib.Path, damaged: list[str]) -> dict:
    """The JSON object in `path`, or {} when there is none; a file that is not one (cut short by a kill, damaged)
    is named in `damaged`, so the result says why its checks fail instead of the smoke script stopping on it."""
    doc, why = json_object(path)
    if why:
        damaged.append(f"{path}: {why}")
    return doc


def _below(value, bound: float) -> bool:
    """value <= bound for a number; False for a missing or non-finite one (the trainer writes NaN as null)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value <= bound


def report(run_dir: pathlib.Path, pythons: list[str]) -> dict:
    """The smoke result of the `up` run in `run_dir` (module docstring)."""
    cfg, damaged = read_config(run_dir), []
    summary = read_json(run_dir / "summary.json", damaged)
    sampler = read_json(run_dir / "sampler-0.json", damaged)
    log_path = run_dir / "logs" / "sampler-0.log"
    installs = log_path.read_text(errors="replace").count("vLLM engine: weights installed") if log_path.exists() else 0
    steps, agreement = cfg["trainer"]["steps"], summary.get("logprob_agreement_lag0") or {}
    trainer_final, sampler_final = summary.get("final_weights") or {}, sampler.get("final_weights") or {}
    versions = sampler.get("versions") or []
    checks = {
        "trainer_steps": _check(summary.get("steps"), f"== {steps}", summary.get("steps") == steps),
        "final_version_installed": _check(versions[-1] if versions else None, f"== {steps}",
                                          bool(versions) and versions[-1] == steps),
        "groups_dropped_invalid": _check(summary.get("groups_dropped_invalid"), "== 0",
                                         summary.get("groups_dropped_invalid") == 0),
        "logprob_agreement_lag0_mean_abs": _check(agreement.get("mean_abs"), f"<= {AGREEMENT_MEAN_ABS} (or no token "
                                                  "at lag 0)", not agreement.get("tokens")
                                                  or _below(agreement.get("mean_abs"), AGREEMENT_MEAN_ABS)),
    }
    greedy = trainer_final.get("greedy"), sampler_final.get("greedy")
    accuracy = {k: (summary.get(k) or {}).get("accuracy") for k in ("eval_before", "eval_after")}
    run = {"engine": cfg["sampler"]["engine"], "weight_updates": cfg["sampler"]["weight_updates"],
           "model": cfg["model"].get("path"), "steps": summary.get("steps"),
           "groups_trained": summary.get("groups_trained"), "groups_generated": summary.get("groups_generated"),
           "generation_wasted_fraction": summary.get("generation_wasted_fraction"),
           "groups_trained_mixed_versions": summary.get("groups_trained_mixed_versions"),
           "weight_versions_published": summary.get("weight_versions_published"), "versions_installed": versions,
           "weight_installs_logged": installs, "rl_seconds": summary.get("rl_seconds"),
           "wall_seconds": summary.get("wall_seconds"), "logprob_agreement_lag0": agreement,
           "heldout_accuracy": accuracy,
           "final_greedy_equal": None if None in greedy else greedy[0] == greedy[1]}
    return {"format": FORMAT, "passed": all(c["ok"] for c in checks.values()) and not damaged, "checks": checks,
            "run": run, "damaged": damaged, "environments": [probe(p) for p in pythons]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_stream.reports.smoke", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--python", action="append", default=[], help="an interpreter to describe (repeatable)")
    parser.add_argument("--out", type=pathlib.Path, help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)
    if not (args.run_dir / "config.yaml").exists():
        print(f"{args.run_dir}: no config.yaml; not an `up` run directory", file=sys.stderr)
        return 2
    try:
        result = report(args.run_dir, args.python or [sys.executable])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
