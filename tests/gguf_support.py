"""A tiny Llama GGUF written the way llama.cpp's converter writes one, with its reference model, for the GGUF
importer's tests.

`write_tiny_gguf` makes a random `transformers` Llama and a byte-level BPE tokenizer trained here (digits split one
by one, as SmolLM2's), quantizes every matrix (Q8_0 and Q4_1, the SmolLM2 file's types), permutes the rows of q/k per
head as llama.cpp's converter does (`llama_cpp_permute`, written from its description, independently of the
importer's inverse), and writes metadata, tokenizer fields and a chat template. The reference model it returns holds
the dequantized weights in HF order: quantization works within rows (blocks of 32 along the input dimension) and
the permutation only reorders rows, so the two commute, and the converted directory must give this model's logits.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=100000.0,
             tie_word_embeddings=True)
CORPUS = ["The capital of France is Paris.", "What is 12 + 7? It is 19.", "Café naïve façade — déjà vu 😀",
          "def add(a, b):\n    return a + b\n", "In 2024 there were 365 days; 1,234.56 dollars."]


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from HF's: per head, the first half's row i goes to 2i, the second half's to 2i+1."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CONTROL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def _tokenizer_fields(writer, tok) -> int:
    import gguf

    state = json.loads(tok.to_str())["model"]
    vocab = sorted(state["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in CONTROL else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)  # as SmolLM2's: padding with the stop token
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    return len(vocab)


def _metadata(writer, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


GGUF_NAMES = {"embed_tokens": "token_embd", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "norm": "output_norm"}


def gguf_name(hf_name: str) -> str:
    parts = hf_name.removeprefix("model.").removesuffix(".weight").split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{GGUF_NAMES[parts[-1]]}.weight"
    return f"{GGUF_NAMES[parts[-1]]}.weight"


def write_tiny_gguf(path: pathlib.Path, seed: int = 0, extra_tensors: dict | None = None, big_endian: bool = False,
                    matrix_type: str | None = None):
    """(the reference `transformers` model, the trained `tokenizers` Tokenizer) of the GGUF written to `path`.
    `big_endian`: the file in big-endian byte order; `matrix_type`: every matrix as this GGML type ("F32", "F16";
    default Q8_0 for the embedding and Q4_1 for the others)."""
    import gguf
    import torch
    import transformers

    tok = train_tokenizer()
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), bos_token_id=1, eos_token_id=2,
                                      **{k: v for k, v in SHAPE.items() if k != "rope_theta"},
                                      rope_parameters={"rope_type": "default", "rope_theta": SHAPE["rope_theta"]})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama",
                             endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    _metadata(writer, config)
    assert _tokenizer_fields(writer, tok) == config.vocab_size
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            value = param.numpy().copy()  # the original: param is overwritten with its dequantized value
            if value.ndim == 1:  # norms stay float32, randomised so a mis-mapped one cannot hide behind ones
                value = (1.0 + 0.2 * rng.standard_normal(value.shape)).astype(np.float32)
                param.copy_(torch.from_numpy(value))
                writer.add_tensor(gguf_name(f"model.{name}"), value)
                continue
            qtype = gguf.GGMLQuantizationType.Q8_0 if "embed" in name else gguf.GGMLQuantizationType.Q4_1
            if matrix_type is not None:
                qtype = gguf.GGMLQuantizationType[matrix_type]
            quantized = gguf.quants.quantize(value, qtype)
            param.copy_(torch.from_numpy(gguf.quants.dequantize(quantized, qtype).reshape(value.shape)))
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
            stored = gguf.quants.quantize(llama_cpp_permute(value, heads), qtype) if heads else quantized
            writer.add_tensor(gguf_name(f"model.{name}"), stored, raw_dtype=qtype)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tok
