"""Hugging Face tokenizers from a directory: ids, stop tokens, pad checks, chat and reasoning prompt templates."""

import json
import subprocess
import sys

import pytest

from grpo_stream.common.tasks import prompts
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.common.model.tokenizer import HFTokenizer, train_bpe
from tests.chatml_tokenizer import chatml_tokenizer_dir

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    tiny = train_bpe(ArithTask(10, 99, 0.1, seed=0).corpus(500), 120)
    tiny.save(directory)
    return directory, tiny


def test_same_ids_as_the_tokenizer_it_was_saved_from(tok_dir):
    directory, tiny = tok_dir
    hf = HFTokenizer(directory)
    text = " 47 + 38 = 85 #### 85"
    assert hf.encode(text) == tiny.encode(text) and hf.decode(hf.encode(text)) == text
    assert (hf.pad_id, hf.eos_ids, hf.vocab_size) == (tiny.pad_id, [tiny.eos_id], tiny.vocab_size)
    assert hf.decode(hf.encode(text) + [hf.eos_id, hf.pad_id]) == text  # specials never reach reward functions


def test_stop_tokens_include_generation_config(tok_dir, tmp_path):
    directory, tiny = tok_dir
    for f in directory.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tiny.eos_id, 7]}))
    assert HFTokenizer(tmp_path).eos_ids == sorted({tiny.eos_id, 7})


@pytest.mark.parametrize("pad, message", [
    ("<eos>", r"model.pad_token='<eos>' is an end-of-sequence token"),
    ("<nope>", r"model.pad_token='<nope>' is not a token"),
])
def test_bad_pad_tokens_are_refused(tok_dir, pad, message):
    with pytest.raises(ValueError, match=message):
        HFTokenizer(tok_dir[0], pad_token=pad)


def test_missing_tokenizer_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match=f"model.path={tmp_path}: no loadable tokenizer"):
        HFTokenizer(tmp_path)


def test_prompt_templates(tok_dir, tmp_path):
    directory, _ = tok_dir
    hf = HFTokenizer(directory)
    assert prompts.render("2 + 2?", "plain", hf) == "Q: 2 + 2? A:"
    with pytest.raises(ValueError, match="no chat template; use 'plain'"):
        prompts.render("2 + 2?", "chat", hf)
    for f in directory.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    chat = HFTokenizer(tmp_path)
    assert prompts.render("2 + 2?", "chat", chat) == "<|user|>2 + 2?\n<|assistant|>"
    reasoning = prompts.render("2 + 2?", "reasoning", chat)
    assert reasoning.startswith("<|system|>") and "<reasoning>" in reasoning and "<answer>" in reasoning
    assert reasoning.endswith("<|user|>2 + 2?\n<|assistant|>")


def test_a_plain_tokenizer_next_to_a_qwen_config_keeps_its_own_pre_tokenizer(tok_dir, tmp_path):
    """transformers 5's AutoTokenizer would swap in Qwen's tokenizer class for model_type qwen3; we must not."""
    directory, tiny = tok_dir
    for f in directory.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    text = "Q: Zoe found 18 books and then 72 more. How many in all? A:"
    assert HFTokenizer(tmp_path).encode(text) == tiny.encode(text)


def test_threads_can_load_tokenizers_at_once_in_a_fresh_process(tok_dir):
    """weights.transport=local's trainer and sampler threads load their tokenizers together; transformers' lazy
    module, imported from two threads at once, made one of them fail with "cannot import name 'AutoTokenizer'"."""
    import subprocess
    import sys

    directory, _ = tok_dir
    code = ("import sys, threading\nfrom grpo_stream.common.model.tokenizer import HFTokenizer\nerrors = []\n"
            "def load():\n    try:\n        HFTokenizer(sys.argv[1])\n    except Exception as exc:\n"
            "        errors.append(repr(exc))\nthreads = [threading.Thread(target=load) for _ in range(3)]\n"
            "[t.start() for t in threads]\n[t.join() for t in threads]\nprint(errors)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_a_tokenizer_padding_with_its_stop_token_is_refused_naming_safe_candidates(tmp_path, caplog):
    """SmolLM2's files pad with <|im_end|>, its stop token: the refusal names <|endoftext|> (a special token that is
    neither a stop, the BOS nor a token the chat template writes), and model.pad_token=auto takes it, saying so."""
    directory = chatml_tokenizer_dir(tmp_path / "chatml")
    with pytest.raises(ValueError, match=r"the tokenizer's pad token '<\|im_end\|>' \(model.pad_token: null\) is an "
                                         r"end-of-sequence token.*safe candidates in this vocabulary: <\|endoftext\|>;"
                                         r" or model.pad_token=auto") as refused:
        HFTokenizer(directory)
    assert "<|im_start|>" not in str(refused.value)  # the BOS and chat role token is never offered
    with pytest.raises(ValueError, match=r"model.pad_token='<\|im_end\|>' is an end-of-sequence token.*"
                                         r"<\|endoftext\|>"):
        HFTokenizer(directory, pad_token="<|im_end|>")
    with caplog.at_level("INFO", logger="grpo_stream.common.model.tokenizer"):
        auto = HFTokenizer(directory, pad_token="auto")
    assert auto.pad_id == HFTokenizer(directory, pad_token="<|endoftext|>").pad_id == 0
    assert "model.pad_token=auto: padding with '<|endoftext|>'" in caplog.text
    no_pad = chatml_tokenizer_dir(tmp_path / "nopad", pad_token=None)
    with pytest.raises(ValueError, match=r"has no pad token.*safe candidates in this vocabulary: <\|endoftext\|>"):
        HFTokenizer(no_pad)


def test_loading_a_tokenizer_without_torch_prints_no_pytorch_notice(tok_dir):
    """transformers prints "PyTorch was not found. Models won't be available..." at import when torch is absent (the
    default install); every process of an hf run loaded a tokenizer and printed it. It is dropped at our one import
    site; a bare import in the same conditions still prints it (so this test can see it)."""
    hide_torch = "import sys; sys.modules['torch'] = None; "
    ours = subprocess.run([sys.executable, "-c", hide_torch + "from grpo_stream.common.model.tokenizer import "
                           f"HFTokenizer; print(HFTokenizer({str(tok_dir[0])!r}).vocab_size)"],
                          capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0 and ours.stdout.strip() == "120", ours.stderr[-2000:]
    assert "PyTorch was not found" not in ours.stderr, ours.stderr
    bare = subprocess.run([sys.executable, "-c", hide_torch + "import transformers.utils"],
                          capture_output=True, text=True, timeout=120)
    assert "PyTorch was not found" in bare.stderr, bare.stderr[-2000:]


def _byte_level_dir(directory):
    """A byte-level BPE as Llama 3, Qwen and SmolLM2 ship theirs, trained on text whose characters (CJK, emoji,
    accents) are split over tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["日本語のテキスト and plain text", "héllo wörld 🙂 naïve café", "the answer is 42"] * 20
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>", "<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>", "pad_token": "<|pad|>"}))
    return directory


def test_token_bytes_rebuild_text_whose_characters_are_split_over_tokens(tmp_path, tok_dir):
    """The endpoint's logprob `bytes` were each token's decoded text encoded: a token holding part of a character
    decodes to U+FFFD, so the bytes of "日本" were six replacement characters' and rebuilt nothing."""
    hf = HFTokenizer(_byte_level_dir(tmp_path), pad_token="<|pad|>")
    for text in ("日本語のテキスト", "héllo wörld 🙂", "the answer is 42", "未知の字 ☃"):
        ids = hf.encode(text)
        assert b"".join(hf.token_bytes(i) for i in ids).decode() == text
        assert any("\ufffd" in hf.decode([i]) for i in ids) or text.isascii()  # what decoding alone gave
    plain = HFTokenizer(tok_dir[0])  # a Metaspace (SentencePiece-like) vocabulary: its ▁ is a space
    assert b"".join(plain.token_bytes(i) for i in plain.encode(" 47 + 38 = 85")).decode() == " 47 + 38 = 85"


def test_token_bytes_of_added_tokens_of_a_byte_level_vocabulary_keep_their_text(tmp_path):
    """DeepSeek-R1's distilled Qwen models (byte-level BPE) stop on <｜end▁of▁sentence｜>, whose ▁ is part of the
    token's text: the endpoint's logprob `bytes` and text of that stop token were "<｜end of sentence｜>", as if the
    vocabulary were SentencePiece's; `tokenizers` decodes it, and vLLM writes it, with its ▁."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜tool▁calls▁begin｜>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["héllo wörld 🙂", "the answer is 42"] * 10, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": specials[1], "pad_token": "<|pad|>"}))
    hf = HFTokenizer(tmp_path)
    for token in specials[:4]:
        token_id = hf.vocab()[token]
        assert hf.token_bytes(token_id) == token.encode() == hf._tok.decode([token_id]).encode(), token
    text = "<｜User｜>héllo 🙂 42<｜tool▁calls▁begin｜> the answer<｜end▁of▁sentence｜>"
    assert b"".join(hf.token_bytes(i) for i in hf.encode(text)).decode() == text


def test_a_pad_token_the_model_has_no_embedding_row_for_is_refused(tmp_path):
    """A pad token that tokenizer_config.json names but tokenizer.json lacks is appended by transformers with the id
    one past the vocabulary: the engines' `.at[pad_id]` masking dropped it silently (padding could be sampled) and
    vLLM's logit_bias refused it. It is refused naming the safe candidates; a pad in the vocabulary still loads."""
    directory = chatml_tokenizer_dir(tmp_path / "chatml", pad_token="<|my_pad|>")
    rows = len(json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"])
    with pytest.raises(ValueError, match=rf"the tokenizer's pad token '<\|my_pad\|>' \(model.pad_token: null\) has "
                                         rf"id {rows}, past the model's {rows} embedding rows.*<\|endoftext\|>"):
        HFTokenizer(directory, vocab_size=rows)
    assert HFTokenizer(directory, pad_token="<|endoftext|>", vocab_size=rows).pad_id == 0


def test_stop_tokens_the_model_cannot_sample_are_left_out_or_refused(tmp_path, caplog):
    """An EOS that tokenizer_config.json names but tokenizer.json lacks is appended past the vocabulary: the model
    can never sample it, so with it the only stop token every completion ran to its budget. It is refused when no
    other stop token is left, and left out (said in the log) when generation_config.json names one the model has."""
    directory = chatml_tokenizer_dir(tmp_path / "chatml", pad_token="<|endoftext|>")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|eot|>"}))
    rows = len(json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"])
    with pytest.raises(ValueError, match=rf"the stop tokens '<\|eot\|>' \(id {rows}\) are past the model's {rows} "
                                         r"embedding rows.*could never stop"):
        HFTokenizer(directory, vocab_size=rows)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, rows]}))
    with caplog.at_level("WARNING", logger="grpo_stream.common.model.tokenizer"):
        assert HFTokenizer(directory, vocab_size=rows).eos_ids == [2]
    assert f"'<|eot|>' (id {rows}) are past the model's {rows} embedding rows" in caplog.text
