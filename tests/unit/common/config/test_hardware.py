"""hardware: what a run is sized for, as `grpo-stream plan` reads it."""

import re
from pathlib import Path

import pytest

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.hardware import CHIP_MEMORY_BYTES, GIB
from grpo_stream.common.config.loading import load_config


def test_chips_give_their_memory_and_the_sampler_defaults_to_the_trainer_chip():
    hw = load_config(None, ["hardware.trainer_chip=tpu-v5p"]).hardware
    assert hw.device_memory_bytes("trainer") == hw.device_memory_bytes("sampler") == 95 * GIB
    hw = load_config(None, ["hardware.trainer_chip=tpu-v6e", "hardware.sampler_chip=h200"]).hardware
    assert hw.device_memory_bytes("trainer") == 32 * GIB and hw.device_memory_bytes("sampler") == 143_771 << 20


def test_a_memory_override_wins_and_nothing_stated_is_none():
    hw = load_config(None, ["hardware.trainer_chip=h100-80gb", "hardware.trainer_memory_gib=60"]).hardware
    assert hw.device_memory_bytes("trainer") == 60 * GIB and hw.device_memory_bytes("sampler") == 80 * GIB
    assert load_config(None, []).hardware.device_memory_bytes("trainer") is None


@pytest.mark.parametrize("override, field", [("hardware.trainer_chip=tpu-v9", "hardware.trainer_chip"),
                                             ("hardware.margin=1.0", "hardware.margin"),
                                             ("hardware.sampler_memory_gib=0", "hardware.sampler_memory_gib")])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, [override])


def test_every_chip_of_the_table_is_accepted():
    for chip in CHIP_MEMORY_BYTES:
        assert load_config(None, [f"hardware.trainer_chip={chip}"]).hardware.device_memory_bytes("trainer") > 0


def test_shared_devices_turns_off_preallocation_on_a_cpu_host_too():
    """hardware.shared_devices (e.g. a TPU host with weights.transport=local) keeps its meaning without GPUs."""
    from grpo_stream.plan.device_plan import plan_devices

    shared = plan_devices(load_config(None, ["hardware.shared_devices=true"]), [])
    assert all(p.env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} for p in shared.processes)
    assert all(p.env == {} for p in plan_devices(load_config(None, []), []).processes)


@pytest.mark.parametrize("override, field", [("hardware.trainer_devices=[0,0]", "hardware.trainer_devices"),
                                             ("hardware.sampler_devices=[[1],[]]", "hardware.sampler_devices"),
                                             ("hardware.gpus=-1", "hardware.gpus")])
def test_bad_gpu_lists_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, [override])


def test_a_trainer_memory_size_carries_to_the_sampler_without_a_chip_of_its_own():
    """Issue 58: `plan` on CPU with only hardware.trainer_memory_gib exited 2 asking for the sampler's."""
    hw = load_config(None, ["hardware.trainer_memory_gib=24"]).hardware
    assert hw.device_memory_bytes("sampler") == hw.device_memory_bytes("trainer") == 24 * GIB
    hw = load_config(None, ["hardware.trainer_memory_gib=24", "hardware.sampler_chip=h200"]).hardware
    assert hw.device_memory_bytes("sampler") == 143_771 << 20  # a sampler chip named: its own figure


def test_gpu_memory_is_what_nvidia_smi_reported_on_the_gpus_we_ran_on():
    # the file's basis is nvidia-smi's memory.total; the H200 figure was once the data sheet's 141e9 bytes, 9 GiB short
    # of what the device showed, so plans refused runs that fit
    root = Path(__file__).resolve().parents[4]
    for record in sorted(root.glob("bench/results/*/machine.txt")):
        for line in record.read_text().splitlines()[1:]:
            found = re.match(r"NVIDIA (\w+), (\d+) MiB,", line)
            if found and found[1] == "H200":
                assert CHIP_MEMORY_BYTES["h200"] == int(found[2]) << 20, record
                return
    pytest.fail("no H200 machine.txt under bench/results")
