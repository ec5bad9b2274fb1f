"""The plan's compiles on CPU (memory.py: CPU_PLAN_FLAGS) must not count what only the CPU backend allocates. XLA's
CPU backend has no bfloat16 matrix product: it converts each bfloat16 weight to float32 before its product, and
loop-invariant code motion hoisted those converts out of the decode chunk's step loop, so the chunk held a float32
copy of every weight at once, twice the sampler's weights (Llama 3.1 8B on tp 2: 15 GiB of the plan's 40.6 GiB per
device; 70B on tp 8: 33 GiB), which a TPU or GPU, multiplying bfloat16 natively, never allocates. A run on the CPU
does hoist them, so a plan for CPU processes (hardware.*_chip: cpu) still counts the copy."""

import json
import subprocess
import sys

from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.memory import child_env
from tests.conftest import CONFIGS

WIDE = ["model.dtype=bfloat16", "model.tiny.num_layers=4", "model.tiny.embed_dim=512", "model.tiny.hidden_dim=2048",
        "generation.decode_slots=8", "sampler.rows_in_flight=8"]
SAMPLER = """
import json, sys
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.plan.programs import architecture, sampler_programs
cfg = RunConfig.model_validate_json(sys.stdin.read())
plan = sampler_programs(cfg, architecture(cfg))
print(json.dumps({"sizes": plan["per_device_bytes"], "decode": plan["programs"]["decode_chunk"]}))
"""


def sampler_plan(accelerators: bool) -> dict:
    """The sampler's programs of a bfloat16 model whose weights (27 MB) dwarf its KV cache (0.5 MB), compiled in a
    child with the plan's environment for accelerators, or for a run on the CPU."""
    cfg = load_config(CONFIGS / "tiny_arith.yaml", WIDE)
    proc = subprocess.run([sys.executable, "-c", SAMPLER], input=cfg.model_dump_json(),
                          env=child_env(1, accelerators=accelerators), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_a_bfloat16_sampler_decode_holds_no_float32_copy_of_the_weights():
    plan = sampler_plan(accelerators=True)
    weights = plan["sizes"]["parameters"]
    # a float32 copy of every weight is 2x their bfloat16 bytes; the chunk's own buffers (a layer's products, the
    # cache's updates, the logits) are a small part of one copy
    assert plan["decode"]["temporaries"] < weights / 2, plan
    assert plan["sizes"]["temporaries"] < weights / 2, plan


def test_a_plan_for_the_cpu_counts_the_float32_copy_a_cpu_decode_holds():
    plan = sampler_plan(accelerators=False)
    assert plan["decode"]["temporaries"] >= 2 * plan["sizes"]["parameters"], plan


def test_the_plan_compiles_as_its_target_does(monkeypatch):
    """compile_programs: the hoisting off for TPU or GPU devices, on for a run on the CPU."""
    from grpo_stream.plan import memory

    seen = []

    def child(cmd, env, **kwargs):
        seen.append(env["XLA_FLAGS"])
        raise SystemExit  # the environment is all this test reads

    monkeypatch.setattr(memory.subprocess, "run", child)
    for chip in ("h100-80gb", "cpu"):
        cfg = load_config(CONFIGS / "tiny_arith.yaml", [*WIDE, f"hardware.trainer_chip={chip}"])
        try:
            memory.compile_programs(cfg)
        except SystemExit:
            pass
    assert ["while-loop-invariant-code-motion" in flags for flags in seen] == [True, False], seen
