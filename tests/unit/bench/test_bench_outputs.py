"""The benchmarks' command lines and result files: a workload that cannot give a figure is refused before it runs
(`multiturn --set repeats=0` ran every warm-up round, then failed on the median of no runs), and a result is
written whole and as strict JSON (a kill mid-write, or a NaN figure, left a file no reader takes)."""

import json
import math

import pytest

from grpo_stream.bench import multiturn, rollouts


def test_no_timed_run_is_refused_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as raised:
        multiturn.main(["--quick", "--set", "repeats=0"])
    assert raised.value.code == 2 and "give repeats >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("module", [multiturn, rollouts])
def test_a_result_is_written_whole_as_strict_json(module, tmp_path, monkeypatch):
    monkeypatch.setattr(module, "run", lambda *args, **kwargs: {
        "ratio_latency_over_zero": math.nan, "ratio": 0.9, "figure": math.inf})
    monkeypatch.setattr(module, "_say", lambda *args: None, raising=False)
    out = tmp_path / "r.json"
    try:
        module.main(["--quick", "--out", str(out)])
    except (KeyError, TypeError):
        pass  # a summary line after the write may want figures this stand-in lacks; the file is what is checked
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the result"))
    assert doc["ratio"] == 0.9 and doc["figure"] is None
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left beside it
