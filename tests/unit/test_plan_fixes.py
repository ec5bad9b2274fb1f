"""The fixes `grpo-stream plan` prints when a config does not fit are settings the config loader takes as printed
(grpo_stream/plan/memory.py): a user who copies one gets a config that loads, and the KV-cache fix names the setting
that sizes the cache."""

import pathlib
import re

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.memory import sampler_fixes, trainer_fixes

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 1 << 30
SETTING = re.compile(r"(?:^| )([a-z_]+(?:\.[a-z_]+)+=[^\s:]+)")
# a report whose every category is large enough for every fix to be offered
TRAINER = {"parameters": GIB, "optimizer_state": 6 * GIB, "gradients": GIB, "updated_state": 0,
           "activations_and_temporaries": 8 * GIB, "reference_parameters": GIB, "teacher_parameters": 0,
           "publication_copy": 2 * GIB, "total": 20 * GIB,
           "packing": {"rows": 8, "row_tokens": 768, "tokens_per_pass": 8 * 768, "segments_per_row": 2}}
SAMPLER = {"fetch_buffer": GIB, "kv_cache": 10 * GIB, "total": 20 * GIB}


def settings(fix: str) -> list[str]:
    """The dotted overrides a fix names before its colon (its explanation follows)."""
    return SETTING.findall(fix.split(": ", 1)[0])


@pytest.mark.parametrize("preset, overrides, slots", [
    ("llama3.1_8b_gsm8k_tpu_host.yaml", [], 64),  # sampler.rows_in_flight=64 of 256 decode slots sizes the cache
    ("llama3.1_70b_gsm8k_split_slices.yaml", [], 32),  # 8 trainer processes: the loader refuses LoRA there
    ("qwen2.5_1.5b_gsm8k_gpu.yaml", [], 256),
    ("qwen2.5_1.5b_gsm8k_gpu.yaml", ["generation.decode_slots=64", "sampler.rows_in_flight=64"], 64),
])
def test_every_fix_plan_names_loads_as_printed(preset, overrides, slots):
    path = ROOT / "configs" / preset
    cfg = load_config(path, overrides)
    fixes = trainer_fixes(cfg, dict(TRAINER)) + sampler_fixes(cfg, SAMPLER, slots)
    assert any("KV cache" in f for f in fixes)
    for fix in fixes:  # a fix's settings together (halving the slots may lower sampler.rows_in_flight with them)
        load_config(path, [*overrides, *settings(fix)])  # raises ConfigError if the loader refuses them


def test_the_kv_fix_halves_the_rows_the_cache_holds():
    path = ROOT / "configs" / "llama3.1_8b_gsm8k_tpu_host.yaml"
    cfg = load_config(path)
    kv = next(f for f in sampler_fixes(cfg, SAMPLER, 64) if "KV cache" in f)
    fixed = load_config(path, settings(kv))
    assert min(fixed.generation.decode_slots, fixed.rows_in_flight()) == 32


@pytest.mark.parametrize("overrides, offered", [
    (["eval.batch_size=64", "eval.samples=4", "eval.ks=[1,4]"], True),  # the batch sets the rows: halving it helps
    (["eval.batch_size=8", "eval.samples=16", "eval.ks=[1,16]"], False),  # one problem's 16 samples set them
    (["eval.batch_size=64", "generation.decode_slots=16"], False),  # the slots cap them below half the batch
])
def test_a_smaller_eval_batch_is_offered_only_where_it_lowers_the_rows_evaluated(overrides, offered):
    """The evaluation decodes max(eval.batch_size, eval.samples) rows, at most decode_slots: halving a batch below
    the samples or above the slots left the evaluation's KV cache as it was, and the plan did not fit again."""
    cfg = load_config(None, overrides)
    fixes = trainer_fixes(cfg, {**TRAINER, "evaluation": 10 * GIB})
    assert any(f.startswith("eval.batch_size=") for f in fixes) == offered, fixes
