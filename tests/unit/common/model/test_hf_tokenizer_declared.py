"""What a model directory declares beside tokenizer.json: stop ids in config.json when generation_config.json is
absent, a BOS the tokenizer does or does not put before a text, and unreadable JSON files named."""

import json

import pytest

from grpo_stream.common.model.tokenizer import HFTokenizer
from grpo_stream.common.tasks import prompts
from tests.chat_families import build_tokenizer
from tests.chatml_tokenizer import chatml_tokenizer_dir


def with_bos_post_processor(directory, bos="<|begin_of_text|>"):
    """The tokenizer.json with a post-processor writing `bos` before a text, as Llama 3's and Gemma's ship."""
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == bos)
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    path.write_text(json.dumps(spec))
    return directory, bos_id


def without_generation_config(directory, config):
    (directory / "generation_config.json").unlink()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_without_generation_config_the_stop_ids_of_config_json_are_stops(tmp_path):
    """Llama 3.x Instruct's config.json lists <|eot_id|> and <|eom_id|>; transformers and vLLM derive the generation
    config from it when generation_config.json is absent. Reading only the tokenizer's EOS, the policy never stopped
    at the end of its turn (every completion ran to its budget, the stop token trained as prose)."""
    directory = build_tokenizer(tmp_path / "llama3", "llama3")
    declared = HFTokenizer(directory).eos_ids
    tok = HFTokenizer(directory)._tok
    eot, eom = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|eom_id|>")
    assert {eot, eom} <= set(declared)
    without_generation_config(directory, {"model_type": "llama", "eos_token_id": [eot, eom]})
    assert HFTokenizer(directory).eos_ids == declared
    # a multimodal config.json keeps the text model's ids under text_config
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma3",
                                                       "text_config": {"eos_token_id": [eot, eom]}}))
    assert HFTokenizer(directory).eos_ids == declared
    # with a generation_config.json, config.json's ids are not read (as transformers and vLLM do)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [eot, eom]}))
    assert eom not in HFTokenizer(directory).eos_ids


def test_a_plain_prompt_has_a_bos_only_where_the_tokenizer_puts_one(tmp_path):
    """SmolLM2 names <|im_start|> its bos_token but never adds it (its GGUF's add_bos_token is false; vLLM and
    transformers encode a text without it): a plain prompt began with a chat turn opener. Llama 3's post-processor
    writes <|begin_of_text|>: its plain prompt keeps it, once."""
    smol = HFTokenizer(chatml_tokenizer_dir(tmp_path / "smol", pad_token="<|endoftext|>"))
    assert smol.bos_text == ""
    llama_dir, bos_id = with_bos_post_processor(build_tokenizer(tmp_path / "llama3", "llama3"))
    llama = HFTokenizer(llama_dir)
    assert llama.bos_text == "<|begin_of_text|>"
    for tok in (smol, llama):
        text = prompts.render("2 + 2?", "plain", tok)
        question = text.removeprefix(tok.bos_text)
        assert tok.encode(text) == tok.encode_with_special_tokens(question)  # as vLLM encodes the same text
    assert llama.encode(prompts.render("2 + 2?", "plain", llama)).count(bos_id) == 1


@pytest.mark.parametrize("name, text", [("tokenizer_config.json", "{not json"), ("generation_config.json", "[2]"),
                                        ("config.json", "")])
def test_an_unreadable_json_file_of_the_directory_is_named(tmp_path, name, text):
    directory = build_tokenizer(tmp_path / "llama3", "llama3", "llama")
    (directory / name).write_text(text)
    with pytest.raises(ValueError, match=f"model.path: .*{name} (is not readable JSON|holds a list)"):
        HFTokenizer(directory)


@pytest.mark.parametrize("declared", [True, False])
def test_a_tokenizer_json_tokenizers_cannot_parse_is_named(tmp_path, declared):
    """A tokenizer.json written by a newer `tokenizers` (a pre-tokenizer this one lacks) raised the library's bare
    Exception, "data did not match any variant of untagged enum ...", through the service without naming the
    directory or the setting; it is named, with the installed version, by either loader."""
    directory = chatml_tokenizer_dir(tmp_path / "chatml", pad_token="<|endoftext|>")
    spec = json.loads((directory / "tokenizer.json").read_text())
    (directory / "tokenizer.json").write_text(json.dumps({**spec, "pre_tokenizer": {"type": "FromAFutureVersion"}}))
    if not declared:  # AutoTokenizer's path
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config.pop("tokenizer_class")
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"model.path={directory}: no loadable tokenizer there: its tokenizer.json "
                                         r"does not parse \(data did not match .*installed: \d"):
        HFTokenizer(directory)


@pytest.mark.parametrize("declared", ['"2"', "[2, 2.5]", "-1", "true"])
def test_a_mistyped_stop_id_is_named(tmp_path, declared):
    """generation_config.json's eos_token_id as text stopped the load with "'>=' not supported between instances of
    'str' and 'int'"; a fraction or a negative id became a stop id no token has. Null entries stay allowed."""
    directory = chatml_tokenizer_dir(tmp_path / "chatml", pad_token="<|endoftext|>")
    (directory / "generation_config.json").write_text(f'{{"eos_token_id": {declared}}}')
    with pytest.raises(ValueError, match=r"model.path: .*generation_config.json states eos_token_id=.*; a token id "
                                         r"or a list of token ids \(integers from 0\) is expected"):
        HFTokenizer(directory)
    (directory / "generation_config.json").write_text('{"eos_token_id": [2, null]}')
    assert HFTokenizer(directory).eos_ids == [2]
