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


def test_the_planned_cache_holds_both_length_groups_with_fewer_rows_than_slots(tiny_parts, monkeypatch):
    """generation.decode_length_groups=2 with fewer rows in flight than decode slots: the engine bounds its two
    slot groups only by decode_slots whole sequences, so long sequences move to a group of their own and the main
    group widens beside it; the plan counted one group for the rows in flight (1.25x fewer positions here)."""
    import jax

    from grpo_stream.common.engine import slot_table
    from grpo_stream.common.engine.continuous import ContinuousEngine

    overrides = ["model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.head_dim=8",
                 "generation.num_generations=4", "generation.decode_slots=64", "sampler.rows_in_flight=32",
                 "generation.decode_length_groups=2", "generation.max_prompt_tokens=40",
                 "generation.max_new_tokens=88"]
    cfg = load_config(CONFIGS / "tiny_arith.yaml", overrides)
    plan = sampler_programs(cfg, architecture(cfg))
    _, task, tok, model = tiny_parts
    held, fit = [0], slot_table.SlotTable.fit_windows

    def watched(table, *args, **kwargs):  # the cache positions the engine's groups hold after each chunk's fit
        fit(table, *args, **kwargs)
        held[0] = max(held[0], sum(g.size * g.window for g in (table.main, table.long) if g is not None))

    monkeypatch.setattr(slot_table.SlotTable, "fit_windows", watched)
    engine = ContinuousEngine(model, tok.pad_id, -1, 40, 88, 1.0, slots=64, length_groups=2)  # -1: no stop token
    prompt = tok.encode(task.train_problem(0).prompt)
    prompts = [(prompt * 40)[:40]] * 2 + [prompt[:4]] * 30  # the rows in flight: two long prompts among short ones
    engine.generate(model.params, prompts, jax.random.key(0), max_new_tokens=[88] * 32)
    assert engine.stats["moved_rows"] >= 2 and held[0] > plan["slots"] * plan["cache_tokens"]
    assert held[0] <= (plan["slots"] + plan["long_slots"]) * plan["cache_tokens"], (held, plan["long_slots"])
