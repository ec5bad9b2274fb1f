"""The continuous engine's schedule on `bench sampler`'s request sets, counted rather than timed.

    python -m grpo_stream.bench.sampler_schedule [--case longtail|fixed]

A schedule (slot counts, windows, moves between length groups) depends on the rows' budgets and prompt lengths,
the engine's settings and its cost model, not on the weights' values. So this replays the benchmark's exact request
set through the real engine with a small model and prints, for one window (length_groups=1) and
two (length_groups=2): decode steps, slot-steps and the share of them live, cache positions read, rows moved and
programs compiled. The cost model is the benchmark model's (its `row_work`), so the decisions are the ones the
31M-parameter model gets. Takes about a minute per setting on 2 cores.
"""

from __future__ import annotations

import argparse
import json

import jax

from grpo_stream.bench.sampler import FULL, QUICK, build_model
from grpo_stream.bench.sampler_workloads import NO_EOS, longtail_budgets, make_prompts
from grpo_stream.common.engine.continuous import ContinuousEngine


def count(case: str, length_groups: int) -> dict:
    p = FULL
    narrow = {**p, **{k: QUICK[k] for k in ("num_layers", "embed_dim", "hidden_dim", "num_heads", "head_dim")}}
    full_engine = ContinuousEngine(build_model(p), 0, NO_EOS, p["prompt_high"], p["max_new_tokens"], 1.0)
    engine = ContinuousEngine(build_model(narrow), 0, NO_EOS, p["prompt_high"], p["max_new_tokens"], 1.0,
                              slots=p["slots"], chunk_steps=p["chunk_steps"], length_groups=length_groups)
    engine.table.row_work = full_engine.table.row_work
    prompts = make_prompts(p["prompts"], p["generations"], p["prompt_low"], p["prompt_high"], p["vocab_size"], 0)
    budgets = (longtail_budgets(len(prompts), p["max_new_tokens"], p["max_new_tokens"] / 4, 0.9, seed=1)
               if case == "longtail" else [p["max_new_tokens"]] * len(prompts))
    engine.generate(engine.model.params, prompts, jax.random.key(0), max_new_tokens=budgets)
    s = engine.stats
    return {"case": case, "length_groups": length_groups, "decode_steps": s["decode_steps"],
            "slot_steps": s["slot_steps"], "live_share": round(s["live_slot_steps"] / s["slot_steps"], 3),
            "cache_positions_read": s["cache_positions_read"],
            "attention_positions_read": s["attention_positions_read"], "rows_moved": s["moved_rows"],
            "merges": s["merges"], "programs": len(engine.programs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("longtail", "fixed"), default="longtail")
    args = parser.parse_args(argv)
    for groups in (1, 2):
        print(json.dumps(count(args.case, groups)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
