"""`bench soak --quick` (issue 24's soak, shortened to a check that it works): `up` runs the demo loop with
prompt-injection clients, both memory snapshots name every process and Redis, the clients' prompts are answered,
Ctrl-C stops the run cleanly and its audit is clean. The 20-minute figures are in BENCHMARKS.md."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.bench]  # the bench lane (-m bench)


def test_soak_quick_snapshots_every_process_and_ends_with_a_clean_audit(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.bench.soak", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["series"]) >= 2 and result["series"][-1] == result["end"]
    for snap in (result["baseline"], result["end"]):
        assert {"up", "trainer", "sampler-0", "sampler-1", "redis"} <= set(snap["rss_mb"]), snap["rss_mb"]
        assert snap["threads"]["trainer"] > 1
        assert snap["redis_used_memory"] > 0
    assert result["steps_between"] > 0 and result["prompts_answered"] > 0
    assert result["client_errors"] == 0, result["last_client_error"]
    assert result["audit_ok"] and result["up_exit_code"] == 130, result["audit"]  # 130: stopped by Ctrl-C
    assert set(result["growth"]) >= {"trainer", "redis_used_memory"} and result["targets"]["max_growth"]["bound"] == 1.15
