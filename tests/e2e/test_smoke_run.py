"""The smoke run: one `grpo-stream up` of the smoke config (embedded Redis, trainer, two samplers as real OS
processes) with the features of real runs riding along, checked by the tests below for what each must show: the
run's accounting, outputs and export (`eval` and `transformers` on the exported model); the held-out curve of
evaluation during the run (eval.every_steps, issue 59) in every place it is written; weights taken in flight.
One run serves them all (a module fixture): each `up` costs the lane about half a minute of a worker."""

import json
import subprocess
import sys

import pytest

from tests.e2e.test_demo import Run
from tests.e2e.test_up import ROOT, check_run, run_cli, tensorboard_tags
from tests.e2e.wandb_checks import WANDB_OFFLINE, check_wandb_run, offline_runs, read_run, wandb_env

pytestmark = pytest.mark.e2e
EVAL_DUE = {2, 4, 6}  # eval.every_steps=2 of 8 steps; step 8's weights are eval_after's

# What users watch during a run (issue 4), as TensorBoard tags of the trainer.
WATCHED_SCALARS = (
    "train/reward_mean", "train/reward_std", "train/accuracy", "train/advantage_mean", "train/advantage_abs_mean",
    "train/ppo_kl", "train/clip_fraction", "train/ratio_mean", "train/ratio_max", "train/is_weight_mean",
    "train/entropy", "train/response_length_mean", "train/groups_dropped_stale", "train/groups_dropped_filtered",
    "train/buffer_depth", "train/groups_per_second", "train/tokens_per_second", "train/compute_share",
    "sampler_weight_lag/sampler-0", "sampler_weight_lag/sampler-1")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Run:
    tmp_path = tmp_path_factory.mktemp("smoke")
    run_dir = tmp_path / "run"
    # the training features of real model sizes ride along (their exactness has unit tests): AdamW with a warmup
    # and cosine schedule, gradient accumulation over packed passes of 4 rows (168 tokens), whole-layer remat; and the
    # device plan of a one-GPU host (hardware.gpus=1: every process on GPU 0 with its memory cap), whose settings
    # JAX's CPU backend ignores; the trainer's W&B run, offline (a few seconds more than another run's minutes);
    # evaluation every 2 steps on the trainer's background thread; and weights taken in flight (the default) at
    # decode chunks of 2 steps, so a version can land mid-group
    proc = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir),
                   "trainer.optimizer.name=adamw", "trainer.optimizer.weight_decay=0.01",
                   "trainer.optimizer.schedule=warmup_cosine", "trainer.optimizer.warmup_steps=2",
                   "trainer.tokens_per_micro_batch=168", "trainer.remat=full", "hardware.gpus=1",
                   "eval.every_steps=2", "eval.samples=2", "eval.ks=[1,2]", "generation.decode_chunk_steps=2",
                   *WANDB_OFFLINE, env=wandb_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the report command turns the run into plots and a markdown summary (RUN_DIR/report, read by the tests below)
    rep = run_cli("report", str(run_dir), timeout=120)
    assert rep.returncode == 0, rep.stderr
    return Run(run_dir, proc.stdout, json.loads((run_dir / "summary.json").read_text()))


def test_up_smoke_run(smoke, tmp_path):
    run_dir, summary = smoke.dir, smoke.summary
    devices = json.loads((run_dir / "devices.json").read_text())
    assert devices["sharing"] == {"0": ["trainer", "sampler-0", "sampler-1"]}
    for name, cap in (("trainer", "0.450"), ("sampler-0", "0.225"), ("sampler-1", "0.225")):
        assert (f"device settings: CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false "
                f"XLA_PYTHON_CLIENT_MEM_FRACTION={cap}") in (run_dir / "logs" / f"{name}.log").read_text()
    check_run(summary, replicas=2, steps=8)
    # weights reached the samplers mid-run too, not only at the start and the end. Per sampler that depends on
    # timing: in a full-suite run here one sampler installed only two of the five published versions
    installed = summary["sampler_weight_versions"].values()
    assert set().union(*installed) - {0, 8}, summary["sampler_weight_versions"]
    assert 0.0 <= summary["eval_before"]["accuracy"] <= 1.0 and summary["eval_after"]["num_problems"] == 32
    tokens = summary["trainer_tokens"]  # padded, every step would lay out 16 sequences of 24 + 18 tokens
    assert tokens["padded_laid_out"] == 8 * 16 * 42 and 0 < tokens["real"] < tokens["laid_out"]
    # packed (the default): whole passes of 4 rows of 42 tokens, no more than the padded layout's (the demo's
    # sequences are near a row's length: mostly one a row)
    assert tokens["laid_out"] % (4 * 42) == 0 and tokens["laid_out"] <= tokens["padded_laid_out"]
    assert tokens["padding_fraction"] == round(1 - tokens["real"] / tokens["laid_out"], 4)
    # progress lines, TensorBoard event files and per-process logs exist
    assert "step 8/8" in smoke.stdout and "reward" in smoke.stdout
    tags = tensorboard_tags(run_dir / "tb" / "trainer")
    assert tags.get("train/staleness") == "histogram"
    missing = [t for t in WATCHED_SCALARS if tags.get(t) != "scalar"]
    assert not missing, f"missing TensorBoard scalars {missing}; have {sorted(tags)}"
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"trainer.log", "sampler-0.log", "sampler-1.log"}
    # every process beat for `up`'s stall watches (up.trainer_stall_s, up.sampler_stall_s)
    assert {"trainer-0", "sampler-0", "sampler-1"} <= {p.name for p in (run_dir / "heartbeats").iterdir()}
    rows = smoke.metrics()
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))
    rates = [r["train/learning_rate"] for r in rows if "train/loss" in r]  # the rate of the next update
    lr = 1e-3  # trainer.learning_rate's default
    assert rates[0] == pytest.approx(lr / 2) and rates[1] == pytest.approx(lr), rates  # warmup over 2 steps
    assert all(a > b for a, b in zip(rates[1:], rates[2:])) and rates[-1] == pytest.approx(0.0, abs=1e-9), rates
    check_wandb_run(run_dir, steps=8, samplers=["sampler-0", "sampler-1"])
    plotted = json.loads((run_dir / "report" / "plots.json").read_text())["plots"]
    assert {"staleness", "throughput", "buffer"} <= set(plotted), plotted  # the smoke run learns nothing in 8 steps
    for name in plotted:
        png = (run_dir / "report" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name
    assert "held-out greedy accuracy before" in (run_dir / "report" / "report.md").read_text()
    # the trained model was exported as a Hugging Face directory; `eval` on it reproduces eval_after exactly
    # (greedy, same problems), through the HF tokenizer and checkpoint loader
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (run_dir / "model").iterdir()}
    ev = run_cli("eval", "--config", "configs/tiny_arith_smoke.yaml", "--json", str(tmp_path / "eval.json"),
                 "model.kind=hf", f"model.path={run_dir / 'model'}", "warmstart.steps=0", "eval.samples=4",
                 "eval.ks=[1,2,4]", timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["accuracy"] == summary["eval_after"]["accuracy"] and result["num_problems"] == 32
    assert result["examples"] == summary["eval_after"]["examples"]  # the same greedy completions, word for word
    assert set(result["pass_at_k"]) == set(result["maj_at_k"]) == {"1", "2", "4"}
    assert result["pass_at_k"]["1"] <= result["pass_at_k"]["2"] <= result["pass_at_k"]["4"]
    # ... and `transformers` loads the export with its tokenizer and generates from it (the tiny tokenizer is a
    # plain tokenizer.json: PreTrainedTokenizerFast, as AutoTokenizer would swap in Qwen's pre-tokenizer)
    code = ("import sys, transformers as t\n"
            "tok = t.PreTrainedTokenizerFast.from_pretrained(sys.argv[1])\n"
            "m = t.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "ids = tok('Q: Tom has 12 pens and gets 30 more. How many pens now? A:', return_tensors='pt').input_ids\n"
            "out = m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)\n"
            "assert out.shape[1] > ids.shape[1]; print('generated', repr(tok.decode(out[0, ids.shape[1]:])))")
    gen = subprocess.run([sys.executable, "-c", code, str(run_dir / "model")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert gen.returncode == 0 and "generated" in gen.stdout, gen.stderr[-3000:]


def test_held_out_accuracy_every_two_steps_is_in_every_output(smoke):
    """Evaluation during the run: metrics-trainer.jsonl, TensorBoard, W&B (offline), summary.json and `grpo-stream
    report` hold the held-out curve at the due steps, each at its published version."""
    run_dir, summary = smoke.dir, smoke.summary
    assert summary["steps"] == 8 and summary["eval_errors"] == 0
    curve = summary["eval_curve"]
    during = [r["step"] for r in curve if r["when"] == "during"]
    # slower than training, a due version that waited is replaced by the next (counted); the newest due one and the
    # ends are always there
    assert set(during) | set(summary["eval_skipped"]) == EVAL_DUE and not set(during) & set(summary["eval_skipped"])
    assert during == sorted(during) and 6 in during
    assert [r["step"] for r in curve] == [0, *during, 8] and [r["when"] for r in (curve[0], curve[-1])] == [
        "before", "after"]
    assert all(r["version"] == r["step"] and r["num_problems"] == 32 and set(r["pass_at_k"]) == {"1", "2"}
               and set(r["maj_at_k"]) == {"1", "2"} for r in curve)
    assert curve[-1]["accuracy"] == summary["eval_after"]["accuracy"]
    assert set(during) <= set(summary["weight_versions"])  # published versions only
    rows = smoke.metrics()
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, *during, 8]
    assert all(r["eval/version"] == r["step"] and {"eval/pass_at_1", "eval/pass_at_2", "eval/maj_at_2", "eval/reward",
                                                   "eval/reward/answer_correct"} <= set(r) for r in evals)
    assert [r["eval/accuracy"] for r in evals] == pytest.approx([r["accuracy"] for r in curve])
    tags = tensorboard_tags(run_dir / "tb" / "trainer")
    assert {tags.get(t) for t in ("eval/accuracy", "eval/pass_at_1", "eval/maj_at_2", "eval/version")} == {"scalar"}
    (directory,) = offline_runs(run_dir)
    wandb_run = read_run(directory)
    logged = {r["eval/step"]: r["eval/accuracy"] for r in wandb_run.history if "eval/accuracy" in r}
    assert logged == pytest.approx({r["step"]: r["eval/accuracy"] for r in evals})
    report = (run_dir / "report" / "report.md").read_text()
    assert "Held-out evaluation" in report and "| step (version) | greedy accuracy | maj@1 | maj@2 | pass@1 |" in report
    table = [line for line in report.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(line.split("|")[1]) for line in table] == [0, *during, 8]
    assert json.loads((run_dir / "report" / "plots.json").read_text())["plots"]["heldout"]["steps"] == [0, *during, 8]
    assert (run_dir / "report" / "heldout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_weights_taken_in_flight_keep_the_accounting(smoke):
    """sampler.weight_updates=in_flight (the default) through real processes: the sampler hands the engine its weight
    poll as the chunk-boundary refresh, groups carry per-token versions (run-length encoded, validated by the ingest)
    and the oldest as their version, and the run's accounting holds. Whether a publication lands mid-group here
    depends on timing; that versions switch live sequences with exact per-version logprobs is shown
    deterministically in tests/unit/common/engine/test_continuous.py."""
    summary = smoke.summary
    assert 0 <= summary["groups_trained_mixed_versions"] <= summary["groups_trained"]
    assert summary["groups_dropped_invalid"] == 0 and summary["ingest_rejected_invalid"] == 0


def test_each_sampler_reports_how_full_its_stream_kept_its_engine(smoke):
    """The sampler's JSON says how many rows its engine decoded per step on average (gpu-check sets it beside the
    engine alone): at least one, at most the rows it keeps in flight."""
    for i in range(2):
        sampler = json.loads((smoke.dir / f"sampler-{i}.json").read_text())
        assert 1 <= sampler["engine_rows_decoding_mean"] <= sampler["rows_in_flight"], sampler
        # a fresh sampler compiles its programs on the engine's thread while it has work: counted, and within it
        assert 0 < sampler["compile_seconds"] < sampler["generate_seconds"], sampler
