"""The whole loop with a Hugging Face checkpoint in bfloat16 (model.kind=hf): load, train, publish bf16 weights to
two samplers, evaluate, export; then the export evaluates to the same accuracy."""

import json

import pytest

from tests.e2e.test_up import check_run, run_cli

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# One family end to end: the loop does not depend on the architecture, and every family's load, bfloat16 logits and
# export round trip have unit tests (tests/unit/common/model/test_hf_checkpoint.py); the Llama run that was here
# too cost 100 s of CI's budget and covered nothing more.
@pytest.mark.heavy  # 2 minutes of `up` on a real shape; the tiny hf checkpoint runs stay in the default lane
@pytest.mark.parametrize("family", ["Qwen2Config"])
def test_up_with_a_bfloat16_checkpoint(tmp_path, family):
    from grpo_stream.common.tasks.arith import ArithTask
    from grpo_stream.common.model.tokenizer import train_bpe

    model_dir = tmp_path / "ckpt"
    tok = train_bpe(ArithTask(10, 99, 0.1, seed=0).corpus(4000), 160)
    tok.save(model_dir)
    config = getattr(transformers, family)(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=family == "Qwen2Config",
        pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(model_dir)

    run_dir = tmp_path / "run"
    # room for both samplers' first batches: with one step's worth, the sampler whose first (compiling) batch
    # comes last can find the buffer full for all four steps and contribute nothing
    overrides = ["model.kind=hf", f"model.path={model_dir}", "model.dtype=bfloat16", "warmstart.steps=0",
                 "trainer.steps=4", "buffer.max_groups=16"]
    proc = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir), *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=2, steps=4)
    exported = json.loads((run_dir / "model" / "config.json").read_text())
    assert exported["torch_dtype"] == "bfloat16" and exported["model_type"] == config.model_type
    ev = run_cli("eval", "--config", "configs/tiny_arith_smoke.yaml", "--json", str(tmp_path / "e.json"),
                 "model.kind=hf", f"model.path={run_dir / 'model'}", "model.dtype=bfloat16", "warmstart.steps=0",
                 timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["accuracy"] == summary["eval_after"]["accuracy"]
    assert result["examples"] == summary["eval_after"]["examples"]  # the same greedy completions
