"""What a trainer run leaves behind besides checkpoints: held-out evaluations, the exported Hugging Face model,
and summary.json."""

from __future__ import annotations

import logging
import pathlib
import time

import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.episodes.evaluation import evaluate_run
from grpo_stream.common.runtime.device_memory import device_memory, host_memory
from grpo_stream.common.tasks.rewards import scored_by
from grpo_stream.common.runtime.files import to_json, write_atomic
from grpo_stream.trainer_service.reports.in_run_eval import curve_row

log = logging.getLogger(__name__)


def evaluate_heldout(cfg: RunConfig, engine, params, task, tokenizer, label: str, progress=None) -> dict:
    """Greedy accuracy and mean reward (and sampled pass@k / maj@k with eval.samples) on eval.num_problems held-out
    problems, each made by the run's rollout kind (common/episodes/evaluation.py evaluate_run). The trainer's engine
    is released after it: the weights evaluated (a snapshot, LoRA's merged copy), their decode layout and the
    caches do not stay on the devices beside training."""
    try:
        result = evaluate_run(cfg, engine, params, task, tokenizer, task.heldout(cfg.eval.num_problems), progress)
    finally:
        engine.release()
    sampled = (f", sampled pass@1 {result.pass_at_k['1']:.3f} ({cfg.eval.samples} samples)"
               if "1" in result.pass_at_k else "")
    own = "".join(f", {name} {value:.3f}" for name, value in result.task_metrics.items())  # e.g. IFEval's four
    parts = ", ".join(f"{name} {value:.3f}" for name, value in result.reward_components.items())
    log.info("%s: held-out greedy %s %.3f (%s), accuracy (answer_correct) %.3f%s%s on %d problems (%.1fs); e.g. %r",
             label, scored_by(result.reward_weights), result.reward, parts, result.accuracy, sampled, own,
             result.num_problems, result.seconds, result.examples[0]["completion"] if result.examples else "")
    return result.as_dict()


def eval_curve(carried: dict, eval_after: dict | None, steps: int) -> list[dict]:
    """summary.json's `eval_curve`: eval_before at step 0, the evaluations during RL (one row per step: a resumed
    run's replayed steps are not listed twice), eval_after at the last step."""
    during = {row["step"]: row for row in carried.get("eval_curve") or []}
    rows = [curve_row(0, "before", carried["eval_before"])] if carried.get("eval_before") else []
    rows += [during[s] for s in sorted(during)]
    return rows + ([curve_row(steps, "after", eval_after)] if eval_after else [])


# summary.json's figures a resumed trainer counts from its own start only (docs/operations.md, "Outputs")
SINCE_THIS_START = ("checkpoints_saved", "groups_generated", "generation_wasted_fraction", "weight_versions_published",
                    "weight_versions", "weight_publish_seconds_mean", "trainer_tokens", "device_memory",
                    "host_memory", "logprob_agreement_lag0", "rl_seconds", "wall_seconds")


def wasted_fraction(generated: int, trained: int) -> float | None:
    """Share of the groups generated for training that were never trained (None before any was generated)."""
    return round(min(1.0, max(0.0, 1.0 - trained / generated)), 4) if generated else None


def write_summary(path: pathlib.Path, cfg: RunConfig, *, steps: int, counters: dict, by_sampler: dict, publisher,
                  durability, agreement: dict, mesh_shape: dict, final_weights: dict | None, carried: dict,
                  eval_after: dict | None, rl_seconds: float, started: float, resumed_from: dict | None,
                  trained_here: int, trainer_state: dict | None = None, tokens: dict | None = None) -> dict:
    """`trained_here`: groups this trainer process trained (a resumed run's earlier ones are not its samplers').
    `trainer_state`: what the updater holds (bytes of parameters and optimizer state, what is trained). `tokens`:
    the real and laid-out tokens of the batches this process trained (the padding the update computed over, packed
    or not), and the tokens the padded layout lays out (`padded_laid_out`)."""
    generated = publisher.samplers.groups_generated()
    # trained groups wait in the stream, unacknowledged, until the checkpoint after theirs is safe (durability.py):
    # after a stop they are trained (`grpo-stream audit` says so) though the buffer's counter does not count them yet
    held = durability.held()
    summary = {
        "run": cfg.run.name,
        "steps": steps,
        "trainer_processes": cfg.trainer.processes,
        "stopped_early": steps < cfg.trainer.steps,
        "trainer_epoch": durability.epoch,
        "resumed_from": resumed_from,
        "checkpoints_saved": durability.checkpointed,
        # generated for training (the samplers' reports while this trainer ran; `up` puts the samplers' exact
        # final counts here) and the share of them never trained: dropped, refused, or left in a queue at the end
        "groups_generated": generated,
        "generation_wasted_fraction": wasted_fraction(generated, trained_here),
        "groups_ingested": counters["ingested"],
        "groups_trained": counters["trained"] + held,
        "groups_trained_unacknowledged": held,  # of groups_trained: their acknowledgement waits for a checkpoint
        # sampler.weight_updates=in_flight: trained groups whose tokens span more than one weight version
        "groups_trained_mixed_versions": counters.get("trained_mixed_versions", 0),
        "groups_dropped_stale": counters["dropped_stale"],
        "groups_dropped_invalid": counters["dropped_invalid"],
        "groups_dropped_filtered": counters["dropped_filtered"],
        "groups_dropped_duplicate": counters["dropped_duplicate"],
        "groups_left_in_buffer": max(0, counters["depth"] - held),  # waiting, not trained
        "groups_by_sampler": by_sampler,
        "ingest_rejected_invalid": counters["refused_invalid"],
        "ingest_refused_duplicate": counters["refused_duplicate"],
        "ingest_backpressure_replies": counters["refused_full"],
        "weight_versions_published": len(publisher.published),
        "weight_versions": publisher.published,
        "weight_transport": cfg.weights.transport,
        "weight_publish_seconds_mean": (round(float(np.mean(publisher.publish_seconds)), 4)
                                        if publisher.publish_seconds else None),
        "trainer_mesh": mesh_shape,
        "trainer_state": trainer_state,
        "trainer_tokens": None if not tokens or not tokens["laid_out"] else {
            **tokens, "padding_fraction": round(1.0 - tokens["real"] / tokens["laid_out"], 4),
            "laid_out_vs_padded": round(tokens["laid_out"] / tokens["padded_laid_out"], 4)
            if tokens.get("padded_laid_out") else None},
        # this process's peak device memory (None on CPU): scripts/gpu-check.sh compares it with `plan`'s figure
        "device_memory": device_memory(),
        # its peak resident memory (on CPU the devices' arrays too): what `plan` on CPU estimates
        "host_memory": host_memory(),
        "final_weights": final_weights,
        # a copy: the weight service's threads still record samplers' reports (a new id, a forgotten one) meanwhile
        "sampler_weight_versions": {sid: list(v) for sid, v in dict(publisher.samplers.installed).items()},
        "algo": cfg.algo.model_dump(mode="json"),
        "distill": cfg.distill.model_dump(mode="json") if cfg.distill.enabled else None,
        "logprob_agreement_lag0": {
            "tokens": int(agreement["tokens"]),
            "mean_abs": agreement["abs_sum"] / agreement["tokens"] if agreement["tokens"] else None,
            "max_abs": agreement["max_abs"] if agreement["tokens"] else None},
        "warmstart": carried["warmstart"],
        "eval_before": carried["eval_before"],
        "eval_after": eval_after,
        # held-out evaluations in step order: before RL (step 0), during it (eval.every_steps), after it
        "eval_curve": eval_curve(carried, eval_after, steps),
        # due during RL and never evaluated: replaced by a newer version while waiting, or pending when the run stopped
        # (or when the checkpoint a resumed run restarted from was saved)
        "eval_skipped": carried.get("eval_skipped", []),
        "eval_errors": carried.get("eval_errors", 0),  # evaluations during RL that raised (logged; the run went on)
        "rl_seconds": round(rl_seconds, 2),
        "wall_seconds": round(time.time() - started, 2),
        # which figures count since this trainer process started (at `resumed_from` when set), not the whole run:
        # carrying them through checkpoints would make every checkpoint format change a migration
        "figures_since_this_start": list(SINCE_THIS_START),
    }
    write_atomic(path, to_json(summary, indent=2))  # whole or not at all; NaN as null (files.py)
    log.info("summary written to %s", path)
    return summary
