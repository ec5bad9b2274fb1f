"""Prompt injection end to end on the CPU demo: `up` runs, a client injects evaluation probes (train=false) and
training prompts (train=true) with `grpo-stream submit --follow`, the probes are answered by at least two policy
versions as training proceeds, and the audit shows no probe was ever trained on while every train=true prompt
was."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_up import ROOT, run_cli
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 45


def probes(wave: int) -> list[dict]:
    return [{"question": f"Ana has {a} coins and gets {b} more. How many coins now?", "answer": str(a + b),
             "tags": ["probe", f"wave{wave}"], "num_generations": 2}
            for a, b in ((23, 45), (38, 47), (61, 19), (14, 72))]


def training_prompts() -> list[dict]:
    return [{"question": f"Sam found {a} shells and then {b} more. How many in all?", "answer": str(a + b),
             "train": True, "priority": 5, "tags": ["extra"]} for a, b in ((27, 36), (44, 48), (15, 65), (53, 29))]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def submit(run_dir, path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "grpo_stream", "submit", str(path), "--run-dir", str(run_dir),
                             "--follow"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-2000:]
    lines = [json.loads(line) for line in out.splitlines()]
    assert "prompt_ids" in lines[0]
    return lines[1:]


def run_status(run_dir) -> dict | None:
    """`grpo-stream status` of the run, or None while its PromptService does not answer yet."""
    if not (run_dir / "endpoints.json").exists():
        return None
    proc = run_cli("status", "--run-dir", str(run_dir), "--wait", "2", timeout=60)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def trainer_step(run_dir) -> int:
    status = run_status(run_dir)
    return -1 if status is None else status["trainer_step"]


# an `up` run (~140 s of a CI worker, stop 76); injection's RPCs, queue and results stay in the default lane
# (tests/integration/test_prompt_service.py, test_client_cli.py)
@pytest.mark.heavy
def test_injected_probes_follow_the_policy_and_are_never_trained(tmp_path):
    run_dir = tmp_path / "run"
    up = subprocess.Popen(
        [sys.executable, "-m", "grpo_stream", "up", "--config", "configs/tiny_arith.yaml", "--run-dir", str(run_dir),
         f"trainer.steps={STEPS}", "warmstart.steps=0", "trainer.eval_before=false", "trainer.eval_after=false",
         "trainer.max_staleness=16", "checkpoint.every=20",
         # `audit --group` (below) reads a group's own records, which compaction folds into counts behind the
         # acknowledged checkpoint: this run keeps them. Audits of compacted trails: test_audit_compaction.py,
         # test_fault_injection.py, test_chaos.py.
         "buffer.compact_audit=false"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    def step_reached(step: int) -> bool:
        assert up.poll() is None, f"up exited ({up.returncode}) before trainer step {step}"
        return trainer_step(run_dir) >= step

    try:
        wait_for(lambda: step_reached(0), 300, "the PromptService to answer", interval_s=1)
        write_jsonl(tmp_path / "wave1.jsonl", probes(1) + training_prompts())
        first = submit(run_dir, tmp_path / "wave1.jsonl")
        wave1 = finish(first)
        wait_for(lambda: step_reached(STEPS // 3), 600, f"trainer step {STEPS // 3}", interval_s=1)
        # the second wave goes out once both samplers run a newer policy than any that answered the first: then
        # every answer to it is newer too (a sampler's version only grows), whatever the scheduling
        newest = max(r["policy_version"] for r in wave1 if not r["train"])

        def samplers_past_newest() -> bool:
            assert up.poll() is None, f"up exited ({up.returncode}) before the second wave"
            samplers = (run_status(run_dir) or {"samplers": []})["samplers"]
            return len(samplers) == 2 and all(s["installed_version"] > newest for s in samplers)

        wait_for(samplers_past_newest, 600, f"both samplers past version {newest}", interval_s=1)
        write_jsonl(tmp_path / "wave2.jsonl", probes(2))
        wave2 = finish(submit(run_dir, tmp_path / "wave2.jsonl"))
        output, _ = up.communicate(timeout=600)
        assert up.returncode == 0, output[-3000:]
    except AssertionError as exc:  # with what the run printed: a failed submit says little by itself
        if up.poll() is None:
            up.kill()
        tail = (up.communicate(timeout=60)[0] or "")[-6000:] if up.stdout and not up.stdout.closed else ""
        raise AssertionError(f"{exc}\n--- grpo-stream up's output (tail):\n{tail}") from None
    finally:
        if up.poll() is None:
            up.kill()
    results = wave1 + wave2
    assert all(r["state"] == "done" for r in results)
    probe_results = [r for r in results if not r["train"]]
    assert len(probe_results) == 8 and all(len(r["completions"]) == 2 for r in probe_results)
    versions = {r["policy_version"] for r in probe_results}
    assert len(versions) >= 2, versions  # answered by the policy as it trains
    wave_versions = [[r["policy_version"] for r in probe_results if f"wave{w}" in r["tags"]] for w in (1, 2)]
    assert min(wave_versions[1]) > max(wave_versions[0]), wave_versions  # the later wave saw a newer policy
    print("probe versions by wave:", wave_versions, "reward means:",
          [[round(r["reward_mean"], 2) for r in probe_results if f"wave{w}" in r["tags"]] for w in (1, 2)])
    # the audit: no probe was trained on; every train=true prompt was
    audit = run_cli("audit", str(run_dir), "--json", str(tmp_path / "audit.json"), timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    report = json.loads((tmp_path / "audit.json").read_text())
    injected = report["injected"]
    print("audit:", {k: report[k] for k in ("groups_accepted", "groups_trained", "groups_lost", "groups_trained_twice")},
          injected)
    assert injected["evaluation_only"] == 8 and injected["evaluation_only_trained"] == 0
    assert injected["train"] == 4 and injected["train_trained"] == 4
    one = run_cli("audit", str(run_dir), "--group", probe_results[0]["group_id"], timeout=120)
    history = json.loads(one.stdout)
    assert history["evaluation_only"]["prompt"] == probe_results[0]["prompt_id"]
    assert history["trained_in_steps"] == [] and history["accepted"] is None
    trained = json.loads(run_cli("audit", str(run_dir), "--group", next(
        r["group_id"] for r in results if r["train"]), timeout=120).stdout)
    assert len(trained["trained_in_steps"]) == 1
