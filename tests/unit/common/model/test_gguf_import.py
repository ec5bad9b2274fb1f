"""The GGUF importer on a tiny Llama GGUF written as llama.cpp writes one (tests/gguf_support.py): the converted
directory gives the reference model's logits in our JAX model and in `transformers`, its config states what the
metadata does, its tokenizer encodes as the one it was made from; the q/k un-permutation restores HF's RoPE pairing;
what cannot be converted faithfully is refused by name. The real SmolLM2 file: tests/integration/test_real_model.py."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.model.gguf_import import (GgufError, Metadata, architecture, convert_gguf, float32_value,
                                                  unpermute_rows)
from grpo_stream.common.model.gguf_tokenizer import build_tokenizer, write_tokenizer_files
from grpo_stream.common.model.hf_checkpoint import read_safetensors
from grpo_stream.common.model.policy import causal_mask, load_hf_model, positions_from_mask
from grpo_stream.common.model.tokenizer import HFTokenizer
from tests.gguf_support import CONTROL, TEMPLATE, llama_cpp_permute, write_tiny_gguf

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["What is 12 + 7? It is 19.", "In 2024: 1,234.56 dollars", "Café naïve façade — déjà vu 😀 ∑",
         "<|im_start|>user\nHi 42<|im_end|>\n<|im_start|>assistant\n", "  two  spaces\tand a tab\n\n"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the converted directory, the reference model, the trained tokenizer)."""
    root = tmp_path_factory.mktemp("gguf")
    reference, tok = write_tiny_gguf(root / "tiny.gguf", seed=3)
    lines = []
    convert_gguf(root / "tiny.gguf", root / "hf", pad_token="<|endoftext|>", progress=lines.append)
    assert any("tensors dequantized and written" in line for line in lines)
    return root / "hf", reference, tok


def rope_interleaved(x, positions, theta):
    """llama.cpp's RoPE: rotates rows (2i, 2i+1) of each head by position * theta^(-2i/d). x [T, H, D]."""
    d = x.shape[-1]
    angle = positions[:, None, None] * theta ** (-np.arange(0, d, 2) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * np.cos(angle) - odd * np.sin(angle), odd * np.cos(angle) + even * np.sin(angle)
    return out


def rope_halves(x, positions, theta):
    """HF's RoPE: rotates rows (i, i + d/2) of each head by the same angles."""
    d = x.shape[-1]
    angle = positions[:, None, None] * theta ** (-np.arange(0, d, 2) / d)
    first, second = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                           second * np.cos(angle) + first * np.sin(angle)], axis=-1)


@pytest.mark.parametrize("heads,head_dim", [(1, 2), (3, 8), (9, 64)])
def test_unpermute_inverts_llama_cpp_permutation(heads, head_dim):
    w = np.random.default_rng(heads).standard_normal((heads * head_dim, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, heads)
    assert head_dim == 2 or not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), w)


def test_unpermuted_weights_under_hf_rope_score_as_llama_cpp_does():
    """Attention scores of llama.cpp (its rows, interleaved RoPE) equal HF's on the un-permuted rows (split-half
    RoPE); left permuted, they do not."""
    rng = np.random.default_rng(0)
    heads, head_dim, width, length = 3, 16, 24, 7
    wq_gguf, wk_gguf = (rng.standard_normal((heads * head_dim, width)) for _ in range(2))
    x, positions = rng.standard_normal((length, width)), np.arange(length, dtype=np.float64)

    def scores(wq, wk, rope):
        q = rope((x @ wq.T).reshape(length, heads, head_dim), positions, 1e4)
        k = rope((x @ wk.T).reshape(length, heads, head_dim), positions, 1e4)
        return np.einsum("thd,shd->hts", q, k)

    theirs = scores(wq_gguf, wk_gguf, rope_interleaved)
    np.testing.assert_allclose(scores(unpermute_rows(wq_gguf, heads), unpermute_rows(wk_gguf, heads), rope_halves),
                               theirs, atol=1e-9)
    assert not np.allclose(scores(wq_gguf, wk_gguf, rope_halves), theirs, atol=1e-3)


def reference_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def test_converted_gguf_gives_the_reference_logits(converted):
    directory, reference, _ = converted
    tokens = np.random.default_rng(1).integers(0, reference.config.vocab_size, (2, 48))
    want = reference_logits(reference, tokens)
    ours = load_hf_model(str(directory), "float32")
    valid = jnp.ones(tokens.shape, jnp.bool_)
    got, _ = ours.apply(ours.params, jnp.asarray(tokens), positions_from_mask(valid), None, causal_mask(valid))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    theirs = transformers.LlamaForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    np.testing.assert_allclose(reference_logits(theirs.eval(), tokens), want, atol=1e-4, rtol=1e-4)


def test_config_states_the_metadata(converted):
    directory, reference, _ = converted
    config = json.loads((directory / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-05 and config["tie_word_embeddings"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["max_position_embeddings"] == 512 and config["vocab_size"] == reference.config.vocab_size
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert json.loads((directory / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert float32_value(np.float32(1e-5).item()) == 1e-05 and float32_value(100000.0) == 100000.0


def test_tokenizer_encodes_as_the_one_it_was_made_from(converted):
    directory, _, tok = converted
    ours = HFTokenizer(directory)
    auto = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for text in TEXTS:
        want = tok.encode(text).ids
        assert ours.encode(text) == want == auto.encode(text, add_special_tokens=False), text
        assert ours._tok.decode(want) == text
    digits = ours.encode("x 1234567890")
    assert [ours._tok.convert_ids_to_tokens(i) for i in digits[-10:]] == list("1234567890")
    assert ours.encode("<|im_end|>") == [2] and ours.eos_ids == [2] and ours.pad_id == 0
    assert set(CONTROL) <= set(ours.special_texts())
    chat = ours.render_chat([{"role": "user", "content": "Hi"}], True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((directory / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE


class Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


def metadata(fields: dict) -> Metadata:
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.token_type": [1, 1, 1], "tokenizer.ggml.merges": ["a b"]}
    base.update(fields)
    return Metadata({k: Field(v) for k, v in base.items()}, "x.gguf")


@pytest.mark.parametrize("field,value,match", [
    ("tokenizer.ggml.model", "llama", r"tokenizer\.ggml\.model='llama'; only byte-level BPE"),
    ("tokenizer.ggml.pre", "qwen2", r"tokenizer\.ggml\.pre='qwen2'; converted pre-tokenizers: smollm"),
    ("tokenizer.ggml.merges", ["a b c"], r"merges\[0\]='a b c' is not two tokens"),
    ("tokenizer.ggml.add_bos_token", True, r"add_bos_token"),
])
def test_tokenizers_it_cannot_reproduce_are_refused(field, value, match):
    with pytest.raises(GgufError, match=match):
        build_tokenizer(metadata({field: value}))


@pytest.mark.parametrize("field", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"])
def test_a_tokenizer_field_missing_is_refused_by_name(field):
    meta = metadata({})
    del meta._fields[field]
    with pytest.raises(GgufError, match=rf"x\.gguf: metadata field {field} is missing"):
        build_tokenizer(meta)


def test_a_gguf_that_cannot_be_converted_faithfully_is_refused_by_name(tmp_path):
    write_tiny_gguf(tmp_path / "extra.gguf", extra_tensors={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(GgufError, match=r"tensor blk\.0\.attn_q_norm\.weight has no place in a Llama model"):
        convert_gguf(tmp_path / "extra.gguf", tmp_path / "out", pad_token="<|endoftext|>")
    write_tiny_gguf(tmp_path / "pads.gguf")
    with pytest.raises(GgufError, match=r"padding token '<\|im_end\|>' .* a stop token"):
        convert_gguf(tmp_path / "pads.gguf", tmp_path / "out2")  # the file's own pad is its stop token


LLAMA = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
         "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.attention.layer_norm_rms_epsilon": 1e-5,
         "llama.rope.freq_base": 10000.0, "llama.context_length": 512, "llama.vocab_size": 300}


@pytest.mark.parametrize("fields,refused", [
    ({}, None),
    ({"llama.rope.scaling.factor": 4.0}, r"not stated \(llama\.cpp reads 'linear'\), llama\.rope\.scaling\.factor=4"),
    ({"llama.rope.scale_linear": 2.0}, r"not stated .*, llama\.rope\.scale_linear=2\.0 is not converted"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0},
     r"'linear', llama\.rope\.scaling\.factor=8\.0"),
    ({"llama.rope.scaling.type": "yarn"}, r"'yarn' is not converted"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0}, None),  # a factor of 1 scales nothing
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),  # llama.cpp: none never scales
])
def test_rope_scaling_is_read_as_llama_cpp_reads_it(fields, refused):
    """llama.cpp scales positions by 1/factor when a file states a factor and no type (its default is linear)."""
    meta = Metadata({k: Field(v) for k, v in {**LLAMA, **fields}.items()}, "x.gguf")
    if refused is None:
        assert architecture(meta, {"token_embd.weight"}).rope_theta == 10000.0
        return
    with pytest.raises(GgufError, match=rf"x\.gguf: RoPE scaling llama\.rope\.scaling\.type {refused}"):
        architecture(meta, {"token_embd.weight"})


def test_a_tensor_type_gguf_cannot_dequantize_is_refused_by_name(converted, tmp_path):
    """An I32 output_norm (as many bytes as its F32) passes the layout check; gguf.quants cannot dequantize it."""
    source = converted[0].parent / "tiny.gguf"
    norm = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "output_norm.weight")
    data = bytearray(source.read_bytes())
    type_at = norm.field.offset + 8 + len(norm.name) + 4 + 8 * len(norm.shape)
    data[type_at:type_at + 4] = int(gguf.GGMLQuantizationType.I32).to_bytes(4, "little")
    (tmp_path / "i32.gguf").write_bytes(bytes(data))
    with pytest.raises(GgufError, match=r"i32\.gguf: tensor output_norm\.weight has type I32, which gguf\.quants "
                                        r"cannot dequantize"):
        convert_gguf(tmp_path / "i32.gguf", tmp_path / "out", pad_token="<|endoftext|>")


@pytest.mark.parametrize("fields,match", [
    ({"llama.attention.head_count": 0}, r"llama\.attention\.head_count=0 is not a single positive int"),
    ({"llama.block_count": 2.7}, r"llama\.block_count=2\.7 is not a single positive int"),
    ({"llama.block_count": True}, r"llama\.block_count=True is not a single positive int"),
    ({"llama.rope.freq_base": float("nan")}, r"llama\.rope\.freq_base=nan is not a single positive float"),
    ({"llama.attention.head_count_kv": 3},
     r"llama\.attention\.head_count=4 is not a multiple of llama\.attention\.head_count_kv=3"),
])
def test_damaged_shape_fields_are_refused_by_name(fields, match):
    """A zero divides by zero later, a fraction would be cut to an int, a NaN RoPE base makes every logit NaN."""
    with pytest.raises(GgufError, match=rf"x\.gguf: (metadata field )?{match}"):
        architecture(Metadata({k: Field(v) for k, v in {**LLAMA, **fields}.items()}, "x.gguf"), set())


@pytest.mark.parametrize("matrix_type", ["F32", "F16"])
def test_a_big_endian_file_converts_to_the_same_weights(tmp_path, matrix_type):
    """GGUFReader types a big-endian file's F32/F16 tensors as '>f4'/'>f2'; read as native floats (what
    gguf.quants.dequantize does with them) every norm and matrix became other numbers, silently."""
    reference, _ = write_tiny_gguf(tmp_path / "big.gguf", seed=5, big_endian=True, matrix_type=matrix_type)
    convert_gguf(tmp_path / "big.gguf", tmp_path / "hf", pad_token="<|endoftext|>")
    got = dict(read_safetensors(tmp_path / "hf" / "model.safetensors"))
    want = {f"model.{name}": p.detach().numpy() for name, p in reference.model.named_parameters()}
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_big_endian_file_with_quantized_blocks_is_refused_by_name(tmp_path):
    """Whether a big-endian file's Q8_0 block scales were byte-swapped the file does not say (gguf-py's
    gguf_convert_endian swaps them, its writer does not): refused with the fix, never guessed."""
    write_tiny_gguf(tmp_path / "bigq.gguf", big_endian=True)
    with pytest.raises(GgufError, match=r"bigq\.gguf: tensor token_embd\.weight has type Q8_0 in a file of the other "
                                        r"byte order .* gguf-convert-endian FILE little"):
        convert_gguf(tmp_path / "bigq.gguf", tmp_path / "out", pad_token="<|endoftext|>")


def stop_metadata(fields: dict) -> Metadata:
    base = {"tokenizer.ggml.tokens": ["a", "b", "ab", "<|end|>", "<|eot|>", "<|pad|>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 3, 3, 3], "tokenizer.ggml.eos_token_id": 3,
            "tokenizer.ggml.padding_token_id": 5}
    return metadata({**base, **fields})


def test_end_of_turn_tokens_stop_generation_as_llama_cpp_stops(tmp_path):
    """llama.cpp ends generation on tokenizer.ggml.eot_token_id too (a chat model's <|eot_id|> beside its
    <|end_of_text|>); with the EOS alone as stop token every chat turn ran on to the token budget."""
    ids = write_tokenizer_files(tmp_path, stop_metadata({"tokenizer.ggml.eot_token_id": 4}), None, 64)
    assert ids["eos_token_id"] == 3  # config.json: the file's EOS
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [3, 4]
    assert HFTokenizer(tmp_path).eos_ids == [3, 4]
    with pytest.raises(GgufError, match=r"padding token '<\|eot\|>' .* a stop token \('<\|end\|>', '<\|eot\|>'\)"):
        write_tokenizer_files(tmp_path, stop_metadata({"tokenizer.ggml.eot_token_id": 4}), "<|eot|>", 64)


@pytest.mark.parametrize("fields,match", [
    ({"tokenizer.ggml.token_type": ["1", "1", "1", "3", "3", "3"]},
     r"metadata field tokenizer\.ggml\.token_type\[0\]='1' is not of type int"),
    ({"tokenizer.ggml.tokens": [0, 1, 2, 3, 4, 5]}, r"metadata field tokenizer\.ggml\.tokens\[0\]=0 is not of type"),
    ({"tokenizer.ggml.tokens": "ab"}, r"metadata field tokenizer\.ggml\.tokens is a str, not an array"),
    ({"tokenizer.ggml.merges": [7]}, r"metadata field tokenizer\.ggml\.merges\[0\]=7 is not of type str"),
    ({"tokenizer.ggml.merges": ["a zz"]}, r"tokenizer\.ggml\.merges does not fit tokenizer\.ggml\.tokens .*`zz`"),
    ({"tokenizer.ggml.eos_token_id": "3"}, r"tokenizer\.ggml\.eos_token_id='3' is not a token id"),
    ({"tokenizer.ggml.eos_token_id": 3.7}, r"tokenizer\.ggml\.eos_token_id=3\.7 is not a token id"),
    ({"tokenizer.chat_template": 5}, r"metadata field tokenizer\.chat_template is a int, not the template's text"),
])
def test_mistyped_tokenizer_fields_are_refused_by_name(tmp_path, fields, match):
    """A token type stored as text never equalled CONTROL, so <|end|> was split into pieces without a word; the
    others failed inside `tokenizers` or `int()` naming neither the file nor the field."""
    with pytest.raises(GgufError, match=rf"x\.gguf: {match}"):
        write_tokenizer_files(tmp_path, stop_metadata(fields), None, 64)
