"""Benchmark: the trainer's step time with evaluation during the run (eval.every_steps) against without it.

`bench pipeline`'s setup (the real trainer on the demo config, RL only, fed by a synthetic producer so data never
runs short: what is timed is the trainer's own step) runs in rounds: without evaluation, with it unpaused
(eval.max_share=1) and with it held to a share (eval.max_share=SHARE), in turn, so a drift in the machine's speed
reaches all three. Each starts with eval_before, so the evaluation's programs are compiled before RL, as in a run.
The evaluation is the demo's (greedy and 4 samples each, on 256 of its 768 held-out problems) every EVERY
steps, on the trainer's background thread, on the same devices (here: CPU cores) as the steps. Per run: the mean and
median step seconds after the warm-up steps; reported: the median over the rounds of each, and each setting's ratio
to no evaluation (`*_over_off`; the target is <= 1.05 for the held share, issue 59). The model is random, so every
completion runs to generation.max_new_tokens: the evaluation's largest cost.
"""

from __future__ import annotations

import statistics
import sys

from grpo_stream.bench import pipeline

EVERY, SHARE = 10, 0.05
# eval_before in all three: the evaluation's programs compile before RL, as in a run (not in a timed step)
SETTINGS = {"off": ("trainer.eval_before=true",),
            "on": ("trainer.eval_before=true", f"eval.every_steps={EVERY}", "eval.max_share=1.0"),
            "held": ("trainer.eval_before=true", f"eval.every_steps={EVERY}", f"eval.max_share={SHARE}")}


def run(quick: bool = False, rounds: int | None = None, steps: int | None = None,
        problems: int | None = None) -> dict:
    """`problems`: eval.num_problems (the demo's 768 take minutes under load here; default 256, quick 64)."""
    rounds, steps = rounds or (1 if quick else 3), steps or (12 if quick else 40)
    problems = problems or (64 if quick else 256)
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for i in range(rounds):
        for name, overrides in SETTINGS.items():
            result = pipeline.run(quick, overrides + (f"eval.num_problems={problems}",), steps=steps,
                                  alternate=False)
            runs[name].append(result)
            print(f"bench evaluation: round {i + 1} {name}: mean step {result['mean_step_seconds']} s, median "
                  f"{result['median_step_seconds']} s, evaluated {result['eval_curve_steps']}", file=sys.stderr,
                  flush=True)
    figures = {name: {"mean_step_seconds": statistics.median(r["mean_step_seconds"] for r in rs),
                      "median_step_seconds": statistics.median(r["median_step_seconds"] for r in rs),
                      "evaluated_steps": [r["eval_curve_steps"] for r in rs],
                      "skipped": [r["eval_skipped"] for r in rs], "errors": sum(r["eval_errors"] for r in rs)}
               for name, rs in runs.items()}
    off = figures["off"]
    return {"benchmark": "evaluation", "quick": quick, "rounds": rounds, "steps": steps, "every_steps": EVERY,
            "held_share": SHARE, "eval_problems": problems, **figures,
            **{f"{name}_over_off": round(figures[name]["mean_step_seconds"] / off["mean_step_seconds"], 4)
               for name in ("on", "held")},
            **{f"{name}_median_over_off": round(figures[name]["median_step_seconds"] / off["median_step_seconds"], 4)
               for name in ("on", "held")},
            "per_run_mean_step_seconds": {name: [r["mean_step_seconds"] for r in rs] for name, rs in runs.items()}}


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
