"""`plan` compiles the sampler's engine as the sampler builds it (common/engine/continuous.py: engine_settings): a
sampler serving the OpenAI endpoint holds sampler.openai.max_context_tokens positions per slot, and the plan sized
the cache for the rollouts' prompt + completion only (64 times smaller in the reported case)."""

from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.programs import architecture, sampler_programs
from tests.conftest import CONFIGS


def test_the_planned_cache_holds_the_endpoints_context():
    overrides = ["model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.head_dim=8",
                 "generation.decode_slots=8", "sampler.rows_in_flight=8", "sampler.openai.port=0", "sampler.openai.max_context_tokens=512"]
    cfg = load_config(CONFIGS / "tiny_arith.yaml", overrides)
    plan = sampler_programs(cfg, architecture(cfg))
    rollouts = cfg.generation.max_prompt_tokens + cfg.generation.max_new_tokens
    assert rollouts < 512 <= plan["cache_tokens"], plan["cache_tokens"]


def test_the_sampler_total_holds_a_group_growing_at_the_whole_window():
    """A main slot group that grows while its rows are live (new rows wait after it shrank down the ladder) keeps
    the old group beside the new one until the move ends (slot_table.py, _regroup): from 48 to 64 slots that is
    1.75x the KV cache, and the plan counted one group of 64."""
    overrides = ["model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.head_dim=8",
                 "generation.decode_slots=64", "sampler.rows_in_flight=64"]
    cfg = load_config(CONFIGS / "tiny_arith.yaml", overrides)
    plan = sampler_programs(cfg, architecture(cfg))
    sizes = plan["per_device_bytes"]
    assert plan["slots"] == 64
    assert sizes["temporaries"] >= sizes["kv_cache"] * 48 // 64, sizes  # the 48-slot group beside the 64-slot one
    assert plan["peak_program"] == "regroup"
