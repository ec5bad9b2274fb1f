"""Issue 58: `grpo-stream plan` for a run on the CPU (hardware.trainer_chip=cpu) states each process's expected peak
resident memory from named parts (the runtime and the compile measured in plan's child, the devices' arrays, the
host-side copies the process makes), and checks the run's processes together against the machine's memory.

The child's report is given here (its figures are XLA's, tested in tests/e2e/test_plan.py); the comparison with a
real run's measured peaks is in BENCHMARKS.md ("A real pretrained model: SmolLM2-135M-Instruct on CPU")."""

import copy
import pathlib

import pytest

from grpo_stream.common.config.hardware import host_memory_bytes
from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.host_memory import host_estimates, host_fit
from grpo_stream.plan.memory import render, verdict
from grpo_stream.plan.resident import compile_growth, resident

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 1 << 30
MIB = 1 << 20


def child_report(trainer_devices: int = 1) -> dict:
    """A plan child's report as it comes back for a CPU plan: per-device figures and what it measured of itself."""
    trainer = {"devices": trainer_devices, "mesh": {"fsdp": trainer_devices, "tp": 1}, "parameters": 10 ** 8,
               "peak_program": "update_step",
               "per_device_bytes": {"parameters": 400 * MIB, "optimizer_state": 800 * MIB,
                                    "reference_parameters": 0, "teacher_parameters": 0, "batch": MIB,
                                    "gradients": 400 * MIB, "activations_and_temporaries": 300 * MIB,
                                    "updated_state": 0, "total": 1901 * MIB}}
    sampler = {"devices": 1, "mesh": {"tp": 1}, "slots": 16, "cache_tokens": 128, "peak_program": "prefill",
               "per_device_bytes": {"parameters": 400 * MIB, "fetch_buffer": 400 * MIB, "lora_base": 0,
                                    "decode_weights": 480 * MIB, "kv_cache": 80 * MIB, "temporaries": 40 * MIB,
                                    "total": 1400 * MIB},
               # the child compiled the decode program at its size and 2 more (inside its 200 MiB below), each
               # leaving 30 MiB; a sampler compiles 6 sizes (3 slot counts x 2 windows), the evaluation engine 14
               "decode_compile": {"peak": 30 * MIB, "retained": 30 * MIB, "compiled": 2},
               "decode_variants": {"sampler": 6, "evaluation": 14}}
    measured = {"runtime": {"bytes": 700 * MIB, "note": None}, "trainer_compile": {"peak": 400 * MIB},
                "sampler_compile": {"peak": 200 * MIB}}
    return {"architecture": {"family": "llama3"}, "trainer": trainer, "sampler": sampler, "host_measured": measured}


def config(*overrides: str):
    return load_config(ROOT / "configs/tiny_arith.yaml", ["eval.batch_size=64", "eval.samples=0", *overrides])


def test_cpu_is_a_chip_whose_memory_is_the_machines():
    hw = config("hardware.trainer_chip=cpu").hardware
    assert hw.on_cpu("trainer") and hw.on_cpu("sampler")  # the samplers follow the trainer's chip
    assert hw.device_memory_bytes("trainer") == hw.device_memory_bytes("sampler") == host_memory_bytes() > GIB
    assert config("hardware.trainer_chip=cpu", "hardware.trainer_memory_gib=12").hardware \
        .device_memory_bytes("trainer") == 12 * GIB
    assert not config("hardware.trainer_memory_gib=12").hardware.on_cpu("trainer")  # sized, but not a CPU plan


def test_each_process_peak_is_the_sum_of_its_named_parts():
    cfg = config("hardware.trainer_chip=cpu")
    estimates = host_estimates(cfg, child_report())
    trainer, sampler = estimates["trainer"], estimates["sampler"]
    assert trainer["parts"] == {
        "runtime": 700 * MIB, "devices": 1901 * MIB, "compiled_programs": 400 * MIB,
        "checkpoint_copy": 1200 * MIB,  # parameters and optimizer state, kept while the next update writes anew
        # the evaluation engine's compile (its decode layout and KV cache are in the devices' figure)
        "evaluation_engine": 200 * MIB + 11 * 30 * MIB}
    assert sampler["parts"] == {"runtime": 700 * MIB, "devices": 1400 * MIB,
                                "compiled_programs": 200 * MIB + 3 * 30 * MIB}
    for estimate in (trainer, sampler):
        assert estimate["total"] == sum(estimate["parts"].values()) and estimate["notes"] == []


def test_the_parts_follow_the_config():
    report = child_report(trainer_devices=2)
    two = host_estimates(config("hardware.trainer_chip=cpu", "trainer.mesh.fsdp=2"), report)["trainer"]
    # both fake devices are this process's memory: their arrays twice, and both halves of the state checkpointed
    assert two["parts"]["devices"] == 2 * 1901 * MIB and two["parts"]["checkpoint_copy"] == 2 * 1200 * MIB
    quiet = host_estimates(config("hardware.trainer_chip=cpu", "trainer.eval_before=false",
                                  "trainer.eval_after=false", "eval.every_steps=0"), child_report())["trainer"]
    assert "evaluation_engine" not in quiet["parts"]
    # eval.batch_size episodes in flight (not problems: 8 problems of 8 samples), one group when it is larger, at
    # most the engine's decode slots; 512 rows counted for 64 made the evaluation's KV cache 8 times too large
    rows = lambda *more: host_estimates(config("hardware.trainer_chip=cpu", *more),  # noqa: E731
                                        child_report())["trainer"]["evaluation_rows"]
    assert rows("eval.samples=8", "generation.decode_slots=256") == 64
    assert rows("eval.samples=100", "generation.decode_slots=256") == 100
    assert rows("eval.samples=8", "generation.decode_slots=32", "sampler.rows_in_flight=32") == 32
    assert host_estimates(config("hardware.trainer_chip=h100-80gb"), child_report()) == {}  # not a CPU plan


def test_a_cpu_plan_fits_only_when_the_processes_fit_the_machine_together():
    cfg = config("hardware.trainer_chip=cpu", "hardware.trainer_memory_gib=8", "sampler.replicas=2")
    doc = child_report()
    estimates = host_estimates(cfg, doc)
    for role, estimate in estimates.items():
        doc[role]["host_peak"], doc[role]["host_peak_bytes"] = estimate, estimate["total"]
        doc[role] = verdict(cfg, role, doc[role])
    # each process alone fits 8 GiB less the margin (its devices' arrays even more so) ...
    assert doc["trainer"]["fits"] and doc["sampler"]["fits"]
    together = host_fit(cfg, estimates, doc["trainer"]["usable_bytes"])
    # ... but a trainer and two samplers on one machine do not
    assert together["total_bytes"] == estimates["trainer"]["total"] + 2 * estimates["sampler"]["total"]
    assert not together["fits"]
    small = verdict(load_config(ROOT / "configs/tiny_arith.yaml", ["hardware.trainer_chip=cpu",
                                                                    "hardware.trainer_memory_gib=4"]),
                    "trainer", copy.deepcopy(doc["trainer"]))
    assert small["fits"] is False  # 1.9 GiB of arrays fit 4 GiB; the process's 5.3 GiB do not
    doc["cpu_host"], doc["fits"] = together, False
    text = render(cfg, doc)
    assert "the trainer process's expected peak resident memory" in text and "checkpoint_copy" in text
    assert "compiled_programs" in text and "trainer x 1 + sampler x 2 expected peaks" in text and "DOES NOT FIT" in text


@pytest.mark.skipif(resident() is None, reason="reads Linux's /proc/self/status")
def test_the_child_measures_what_a_phase_adds_to_its_resident_memory():
    held = []

    def allocate():
        block = bytearray(96 * MIB)
        block[::4096] = b"\1" * len(block[::4096])  # touch every page, so it is resident
        held.append(block)
        return "done"

    out, growth = compile_growth(allocate)
    assert out == "done" and growth is not None
    assert 90 * MIB <= growth["retained"] <= growth["peak"] < 200 * MIB


def test_the_local_transport_on_shared_devices_is_planned_as_one_set_of_devices(monkeypatch, capsys):
    """weights.transport=local with both device shares 1 (the default): `up` runs the trainer and the samplers in one
    process on the same devices, and the plan checked each alone ("fits") where together they do not."""
    from grpo_stream.plan import memory

    monkeypatch.setattr(memory, "compile_programs", lambda cfg: copy.deepcopy(child_report()))
    monkeypatch.setattr("grpo_stream.plan.programs.architecture", lambda cfg: None)
    sized = ["hardware.trainer_chip=h100-80gb", "hardware.trainer_memory_gib=3"]
    assert memory.run_plan(config(*sized), None) == 0  # each process on devices of its own: each fits
    capsys.readouterr()
    assert memory.run_plan(config(*sized, "weights.transport=local"), None) == 1
    out = capsys.readouterr().out
    assert "shared devices (weights.transport=local with both device shares 1)" in out, out
    assert "DOES NOT FIT" in out
    halves = ["weights.transport=local", "weights.trainer_devices_fraction=0.5", "weights.sampler_devices_fraction=0.5"]
    assert memory.shares_devices(config(*sized, *halves)) is None  # split devices: planned apart


def test_a_json_path_that_cannot_take_the_report_is_refused_before_compiling(monkeypatch, tmp_path):
    """`plan --json DIR`: the programs compiled (minutes for a large model), then writing the report failed on
    IsADirectoryError; the path is checked first, as `grpo-stream eval` checks its --json."""
    from grpo_stream.common.runtime.errors import SetupError
    from grpo_stream.plan import memory

    def compile_programs(cfg):
        raise AssertionError("compiled before the --json path was checked")

    monkeypatch.setattr(memory, "compile_programs", compile_programs)
    monkeypatch.setattr("grpo_stream.plan.programs.architecture", lambda cfg: None)
    with pytest.raises(SetupError, match="is a directory"):
        memory.run_plan(config("hardware.trainer_chip=h100-80gb"), tmp_path)
