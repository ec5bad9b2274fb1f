"""The transport benchmark runs end to end in quick mode (a smoke check, not a speed test)."""

import json
import subprocess
import sys

import pytest

from tests.e2e.test_up import ROOT

pytestmark = pytest.mark.redis


def test_bench_transport_quick_writes_json(tmp_path):
    out = tmp_path / "transport.json"
    proc = subprocess.run([sys.executable, "-m", "grpo_stream", "bench", "transport", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["groups"] == 16 and result["tokens_per_completion"] == 512
    for key in ("ours", "json", "pickle", "raw_redis"):
        assert result["groups_per_second"][key] > 0
    for key in ("ratio_vs_json", "ratio_vs_pickle", "fraction_of_raw_redis"):
        assert result[key] > 0
