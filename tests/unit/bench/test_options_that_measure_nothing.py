"""Benchmark command lines that would measure nothing, or something other than asked, are refused before anything
runs: a soak whose baseline is at or past its end (one snapshot, so every process's growth read 1.0 and the target
passed), `--quick` beside the figures it replaces, and `bench gpu` options the chosen part never reads (a `--set` on
`sampler` measured the default model)."""

import math

import pytest

from grpo_stream.bench import gpu, soak

SNAPSHOT = {"t": 100.0, "rss_mb": {"trainer": 700.0, "sampler-0": 500.0}, "redis_used_memory": 2_000_000}


def test_a_single_snapshot_gives_no_growth_figure():
    with pytest.raises(ValueError, match="no snapshot after the baseline"):
        soak.envelope_growth([SNAPSHOT])


def test_growth_is_still_read_from_the_thirds_of_a_measured_span():
    later = [{**SNAPSHOT, "t": 100.0 + 20 * k, "rss_mb": {"trainer": 700.0 + 50 * k, "sampler-0": 500.0}}
             for k in range(1, 7)]
    growth = soak.envelope_growth([SNAPSHOT, *later])  # first third: t <= 140 (peak 800); last: t >= 180 (1000)
    assert math.isclose(growth["trainer"], 1000 / 800, abs_tol=1e-3) and growth["sampler-0"] == 1.0


@pytest.mark.parametrize("argv, says", [
    (["--minutes", "3"], "less than --minutes 3.0"),  # the default baseline (5 minutes) past the end
    (["--minutes", "5", "--baseline-minutes", "5"], "less than --minutes 5.0"),
    (["--quick", "--minutes", "10"], "--quick sets its own --minutes"),
    (["--quick", "--clients", "64", "--baseline-minutes", "1"], "--clients, --baseline-minutes"),
])
def test_a_soak_that_cannot_measure_what_it_was_given_is_refused(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(soak, "run", lambda *args: pytest.fail(f"the soak ran with {args}"))
    with pytest.raises(SystemExit) as raised:
        soak.main(argv)
    assert raised.value.code == 2 and says in capsys.readouterr().err


def test_run_refuses_a_baseline_at_the_end_before_up_starts(monkeypatch):
    monkeypatch.setattr(soak.subprocess, "Popen", lambda *args, **kwargs: pytest.fail("`up` was started"))
    with pytest.raises(ValueError, match="less than --minutes"):
        soak.run(minutes=2.0, baseline_minutes=2.0)


@pytest.mark.parametrize("argv, unused", [
    (["sampler", "--set", "model.dtype=float32"], "--set"),
    (["sampler", "--config", "configs/tiny_arith.yaml"], "--config"),
    (["trainer", "--rows", "32"], "--rows"),
    (["engine", "--config", "configs/tiny_arith.yaml", "--plan-json", "plan.json"], "--plan-json"),
])
def test_a_bench_gpu_option_its_part_does_not_read_is_refused(argv, unused, monkeypatch, capsys, tmp_path):
    for part in ("trainer", "sampler", "run_engine"):
        monkeypatch.setattr(gpu, part, lambda *args, **kwargs: pytest.fail(f"the part ran with {args}"))
    with pytest.raises(SystemExit) as raised:
        gpu.main([*argv, "--out", str(tmp_path / "gpu.json")])
    assert raised.value.code == 2 and f"{unused}: not read by the {argv[0]} part" in capsys.readouterr().err
