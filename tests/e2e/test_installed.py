"""`pip install .` as a user gets it: only grpo_stream lands in site-packages (no top-level common, protos, bench,
sampler_service or trainer_service), and the installed copy runs the smoke config end to end from another
directory, with the relative run directory the README uses for `up`, `audit` and `report`."""

import json
import os
import pathlib
import subprocess
import sys
from importlib.metadata import version

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_an_installed_copy_runs_the_loop_and_every_command_takes_a_relative_run_dir(tmp_path):
    site = tmp_path / "site"
    # the wheel setuptools builds from pyproject.toml, installed without its (already present) dependencies; with
    # this environment's setuptools when it is recent enough for pyproject's build requirement (no download)
    isolation = [] if int(version("setuptools").split(".")[0]) < 69 else ["--no-build-isolation"]
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation,
                            "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    top = {p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".egg-info"))} - {"bin"}
    assert top == {"grpo_stream"}, top
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}
    work = tmp_path / "work"
    work.mkdir()

    def cli(*args, timeout=600):
        return subprocess.run([sys.executable, "-m", "grpo_stream", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)

    where = subprocess.run([sys.executable, "-c", "import grpo_stream.common.config.schema as m; print(m.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(site)), where  # the installed copy, not the source tree
    up = cli("up", "--config", str(ROOT / "configs" / "tiny_arith_smoke.yaml"), "--run-dir", "runs/smoke",
             "trainer.steps=4", "trainer.eval_after=false")
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    summary = json.loads((work / "runs" / "smoke" / "summary.json").read_text())
    assert summary["steps"] == 4
    # the resolved config, not just how it was asked for
    resolved = (work / "runs" / "smoke" / "config.yaml").read_text()
    assert "steps: 4" in resolved and "transport: grpc" in resolved
    audit = cli("audit", "runs/smoke", timeout=120)
    assert audit.returncode == 0, audit.stdout[-2000:] + audit.stderr[-2000:]
    report = json.loads((work / "runs" / "smoke" / "audit.json").read_text())
    assert report["ok"] and report["groups_lost"] == 0 and report["groups_trained_twice"] == 0, report
    rep = cli("report", "runs/smoke", timeout=120)
    assert rep.returncode == 0 and (work / "runs" / "smoke" / "report" / "report.md").is_file(), rep.stderr
