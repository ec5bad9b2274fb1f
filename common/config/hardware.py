"""The hardware a run is meant for (`hardware:`), as `grpo-stream plan` checks it: which accelerator the trainer's
and the samplers' devices are, how much memory each has, and the margin a plan must leave free.

`plan` reads it to say before the hardware exists whether the programs fit. `up` reads the GPU layout fields
(`gpus`, `trainer_devices`, `sampler_devices`, `plan_json`) to give each process its GPUs and memory settings
(grpo_stream/plan/device_plan.py), and `trainer_env` / `sampler_env`. Memory per device is what the runtime can hand
out (HBM per TPU chip, or per GPU as nvidia-smi reports it), from the vendors' published figures.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from grpo_stream.common.config.base import Strict

GIB = 1 << 30
MIB = 1 << 20

# accelerator -> bytes of memory per device (a TPU chip, or a GPU)
CHIP_MEMORY_BYTES: dict[str, int] = {
    "tpu-v4": 32 * GIB,
    "tpu-v5e": 16 * GIB,
    "tpu-v5p": 95 * GIB,
    "tpu-v6e": 32 * GIB,
    "a100-40gb": 40 * GIB,
    "a100-80gb": 80 * GIB,
    "h100-80gb": 80 * GIB,
    # nvidia-smi's memory.total on the H200 we ran on (bench/results/h200-2026-11-26/machine.txt); the "141 GB" of
    # the data sheet, read as 141e9 bytes, left 9 GiB of every H200 out of each plan
    "h200": 143_771 * MIB,
}
# the processes run on the CPU: their devices' arrays live in each process's memory beside everything else it holds,
# so plan also estimates each process's peak resident memory (grpo_stream/plan/host_memory.py) and checks the run's
# processes together against the host's memory
CPU_CHIP = "cpu"
ChipName = Literal[(*CHIP_MEMORY_BYTES, CPU_CHIP)]


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class HardwareSection(Strict):
    """What the run is sized for; `grpo-stream plan` checks the config's programs against it."""

    trainer_chip: ChipName | None = Field(None, description="Accelerator of each trainer device (trainer.mesh "
                                          "fsdp x tp of them), or 'cpu' for a run on the CPU: plan then also "
                                          "estimates each process's peak resident memory and checks the trainer's "
                                          "and samplers' together against this machine's memory (or "
                                          "trainer_memory_gib). Null: plan stops and asks for it, unless "
                                          "trainer_memory_gib is given.")
    sampler_chip: ChipName | None = Field(None, description="Accelerator of each sampler device (sampler.mesh.tp "
                                          "per sampler). Null: as trainer_chip.")
    trainer_memory_gib: float | None = Field(None, gt=0, le=4096, description="Memory per trainer device in GiB, "
                                             "overriding trainer_chip's figure (e.g. what is left beside other "
                                             "work).")
    sampler_memory_gib: float | None = Field(None, gt=0, le=4096, description="Memory per sampler device in GiB, "
                                             "overriding the sampler chip's figure. Null: that figure, or when no "
                                             "chip is named at all, trainer_memory_gib.")
    gpus: int | None = Field(None, ge=0, le=256, description="GPUs `up` lays the processes out on. Null: the GPUs "
                             "nvidia-smi lists, less those CUDA_VISIBLE_DEVICES hides (none without nvidia-smi, or "
                             "when JAX_PLATFORMS names no GPU platform); 0: run on the CPU.")
    trainer_devices: list[int] | None = Field(None, description="GPU indices (among those `up` sees) of the "
                                              "trainer: trainer.mesh fsdp x tp of them, process k of "
                                              "trainer.processes taking its share in order. Null: the first ones.")
    sampler_devices: list[list[int]] | None = Field(None, description="GPU indices of each sampler, one list per "
                                                    "sampler index (sampler.mesh.tp of them, or "
                                                    "sampler.vllm.tensor_parallel_size for vLLM), e.g. [[1], [2]]. "
                                                    "Null: the GPUs after the trainer's, shared round-robin when "
                                                    "there are too few, else the trainer's.")
    plan_json: str | None = Field(None, description="The JSON of `grpo-stream plan --json` for this config: where "
                                  "processes share a GPU, their memory caps follow its per-device figures. Null: "
                                  "the trainer gets twice a sampler's share of a shared GPU.")
    shared_devices: bool = Field(False, description="The trainer and every sampler use the same devices (one GPU, "
                                 "or one TPU host with weights.transport=local): plan checks the trainer's total "
                                 "plus sampler.replicas samplers' against one device's memory.")
    trainer_env: dict[str, str] = Field(default_factory=dict, description="Environment variables `up` gives the "
                                        "trainer process (beside its own): e.g. the chips of one TPU VM it may use, "
                                        "so a sampler can take the others (scripts/tpu-vllm-smoke.sh).")
    sampler_env: dict[str, str] = Field(default_factory=dict, description="Environment variables `up` gives every "
                                        "sampler process, as trainer_env.")
    margin: float = Field(0.1, ge=0, lt=1, description="Share of each device's memory a plan leaves free (runtime "
                          "reservations, fragmentation, what a CPU-compiled estimate misses); plan reports a fit "
                          "only below (1 - margin) x memory.")

    @field_validator("trainer_env", "sampler_env", mode="before")
    @classmethod
    def _values_as_text(cls, env: object) -> object:
        """An environment variable's value is text: `CUDA_VISIBLE_DEVICES=1` (YAML reads the integer 1) means "1".
        Only an integer is taken so, as the number it is (`0x10` and `1_000` are "16" and "1000"; `010` stays text);
        YAML has already rewritten a float (`2.10` is 2.1), and floats, booleans and nulls are refused, naming the fix
        (quote the value)."""
        if not isinstance(env, dict):
            return env
        for key, value in env.items():
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise ValueError(f"{key}={value!r}: an environment variable's value is text, and YAML read this one "
                                 f"as {type(value).__name__}; quote it (as \"{key}: '...'\" in the file)")
        return {k: str(v) if type(v) is int else v for k, v in env.items()}

    @field_validator("trainer_devices")
    @classmethod
    def _no_repeats(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (len(set(ids)) != len(ids) or any(i < 0 for i in ids)):
            raise ValueError(f"lists a GPU twice or a negative index ({ids}); give distinct indices from 0")
        return ids

    @field_validator("sampler_devices")
    @classmethod
    def _no_repeats_per_sampler(cls, lists: list[list[int]] | None) -> list[list[int]] | None:
        for k, ids in enumerate(lists or []):
            if not ids or len(set(ids)) != len(ids) or any(i < 0 for i in ids):
                raise ValueError(f"sampler {k}'s list {ids} is empty, repeats a GPU or has a negative index; give "
                                 "distinct indices from 0")
        return lists

    def chip(self, role: Literal["trainer", "sampler"]) -> str | None:
        """The accelerator of `role`'s devices (the sampler's defaults to the trainer's)."""
        return self.trainer_chip if role == "trainer" else (self.sampler_chip or self.trainer_chip)

    def device_memory_bytes(self, role: Literal["trainer", "sampler"]) -> int | None:
        """Memory per device of `role`'s devices, or None when the section names neither a chip nor a size."""
        if role == "sampler" and self.sampler_memory_gib is None and self.chip("sampler") is None:
            # no chip named anywhere (a CPU run, sized in GiB): the sampler's devices are as the trainer's
            return self.device_memory_bytes("trainer")
        gib = self.trainer_memory_gib if role == "trainer" else self.sampler_memory_gib
        if gib is not None:
            return int(gib * GIB)
        chip = self.chip(role)
        if chip == CPU_CHIP:
            return host_memory_bytes()
        return CHIP_MEMORY_BYTES[chip] if chip else None

    def on_cpu(self, role: Literal["trainer", "sampler"]) -> bool:
        """Whether `role`'s processes run on the CPU (its chip, or the trainer's for the samplers, is 'cpu')."""
        return self.chip(role) == CPU_CHIP

    def any_on_cpu(self) -> bool:
        """Whether the trainer's or the samplers' processes run on the CPU."""
        return self.on_cpu("trainer") or self.on_cpu("sampler")
