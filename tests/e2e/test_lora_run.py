"""model.lora in a real run: `grpo-stream up` with an fsdp=2 trainer training rank-2 adapters, over each transport.

The trainer holds optimizer state for the adapters only. The frozen base is published once; every version after
it carries the adapters alone, and each sampler (tp=2 over the grpc transport) merges them into the base itself:
W + (alpha/rank) A B. The samplers' behaviour logprobs agree with the trainer's adapted model at version lag 0,
their final parameters hash the same as the trainer's own merge, and so does the exported Hugging Face model,
loaded back. The base stays frozen: outside the adapted projections the export equals the warm-started model.

The adapters go on the attention projections only: the tiny model's MLP kernels start at zero (Tunix's init), where
gate and up have no gradient, so from-scratch training never moves them and neither would their adapters.
"""

import json
import os

import numpy as np
import pytest

from grpo_stream.common.model.policy import load_hf_model
from grpo_stream.common.weights.snapshot import digest
from tests.e2e.test_up import ROOT, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def tree_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def lora_run(run_dir, *extra):
    # a reward every group varies in (longer completions score higher: tests/e2e/vllm_rewards.py), so every step
    # moves the adapters whatever the smoke model happens to sample (its arithmetic rewards are mostly all zero)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir), *extra,
                   "task.rewards={tests.e2e.vllm_rewards:longer_is_better: 1.0}",
                   "model.lora.rank=2", "model.lora.alpha=4",
                   "model.lora.targets=.*/(q_proj|k_proj|v_proj|o_proj)", "trainer.learning_rate=0.003",
                   "trainer.steps=4", "trainer.eval_before=false", "trainer.eval_after=false",
                   # synchronous: groups of the trainer's current version, so every step compares behaviour
                   # logprobs (the samplers' merge) with the trainer's adapted model at lag 0
                   "trainer.publish_every=1", "trainer.max_staleness=0", "sampler.max_groups_per_version=2",
                   "weights.verify_prompts=4", "warmstart.export=true", "trainer.metrics_port=null",
                   "sampler.metrics_port=null", env=env)


# in the heavy lane since stop 76, for CI time (~75 s of a CI worker each): the adapters, their merge, their
# optimizer state and the frozen base's transport stay in the default lane (test_lora.py, test_lora_base.py)
@pytest.mark.parametrize("transport", [pytest.param("grpc", marks=pytest.mark.heavy),
                                       pytest.param("checkpoint", marks=pytest.mark.heavy),
                                       pytest.param("local", marks=pytest.mark.heavy)])
def test_lora_run_publishes_adapters_and_samplers_merge_them_into_the_base(tmp_path, transport):
    run_dir = tmp_path / "run"
    meshes = ["trainer.mesh.fsdp=2", "sampler.mesh.tp=2"] if transport == "grpc" else []
    proc = lora_run(run_dir, f"weights.transport={transport}", *meshes)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["groups_trained"] >= 4
    state = summary["trainer_state"]
    assert state["lora"]["rank"] == 2 and state["lora"]["weights"] == 4  # q, k, v, o of the one layer
    assert 0 < state["trained_parameters"] < 0.1 * state["model_parameters"]
    # Adam's two moments of the adapters only, against two of the whole model without LoRA
    assert state["optimizer_bytes"] < 0.1 * 2 * state["params_bytes"]
    agreement = summary["logprob_agreement_lag0"]
    assert agreement["tokens"] > 0 and agreement["mean_abs"] < 1e-5 and agreement["max_abs"] < 1e-4
    final = summary["final_weights"]
    full_bytes = state["params_bytes"] * (state["model_parameters"] / (state["model_parameters"]
                                                                       + state["trained_parameters"]))
    for name, doc in summary["samplers"].items():
        assert doc["final_weights"]["sha256"] == final["sha256"], f"{name} runs other weights than the merge"
        assert doc["final_weights"]["greedy"] == final["greedy"]
        # the first install brings the base and the adapters; every later one the adapters alone
        first, *later = doc["fetch_bytes"]
        assert later and first > full_bytes and all(n <= 0.05 * full_bytes for n in later), doc["fetch_bytes"]
    exported = load_hf_model(str(run_dir / "model")).to_named_numpy()
    assert digest(exported) == final["sha256"]  # the export is the merge
    warm = load_hf_model(str(run_dir / "warmstart-model")).to_named_numpy()
    adapted = {n for n in warm if n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert len(adapted) == 4
    for name in warm:
        same = np.array_equal(warm[name], exported[name])
        assert same == (name not in adapted), f"{name}: {'unchanged' if same else 'changed'}"


@pytest.mark.heavy  # a second LoRA `up` run (45 s); the LoRA run over grpc stays in the default lane
def test_a_lora_run_resumes_with_its_trained_adapters(tmp_path):
    """The checkpoints hold the adapters and their optimizer state, beside the frozen base written once: `up` again on
    the finished run restores both, publishes the base again under its new trainer epoch, and the samplers end with exactly the
    weights the first run ended with."""
    run_dir = tmp_path / "run"
    first = lora_run(run_dir)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    before = json.loads((run_dir / "summary.json").read_text())
    again = lora_run(run_dir)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    after = json.loads((run_dir / "summary.json").read_text())
    assert after["resumed_from"]["step"] == 4 and after["trainer_epoch"] != before["trainer_epoch"]
    # the frozen base was written once; each step's checkpoint holds the adapters and their optimizer state only
    ckpt = run_dir / "checkpoints"
    base = tree_bytes(ckpt / "lora-base")
    steps = [p for p in ckpt.iterdir() if p.name.isdigit()]
    assert steps and base > before["trainer_state"]["params_bytes"] / 2
    # fewer bytes than the parameters alone (Orbax's metadata is most of a checkpoint of this tiny model)
    params = before["trainer_state"]["params_bytes"]
    assert all(tree_bytes(p) < params for p in steps), ({p.name: tree_bytes(p) for p in steps}, params)
    assert after["final_weights"]["sha256"] == before["final_weights"]["sha256"]
    for name, doc in after["samplers"].items():
        assert doc["final_weights"]["sha256"] == before["final_weights"]["sha256"], name
