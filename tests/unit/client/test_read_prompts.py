"""How `grpo-stream submit` reads its JSONL file: as UTF-8 whatever the locale, split at line ends only, each bad line
named by its number."""

import json
import re

import pytest

from grpo_stream.client.submit import batch_hint, read_prompts


def test_a_line_that_is_not_utf8_is_named_by_its_number(tmp_path):
    """Before: "'utf-8' codec can't decode byte 0xe9 in position 37", naming neither the file nor the line."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"text": "Q: 1 + 1 A:"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: byte 14 of the line (b'\\xe9') is not UTF-8")):
        read_prompts(path)


def test_line_separators_inside_a_json_string_do_not_split_the_line(tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 unescaped in a string (json.dumps(..., ensure_ascii=False) writes them):
    str.splitlines cut such a line in two, refused as "not JSON (Unterminated string)"."""
    path = tmp_path / "p.jsonl"
    texts = ["Q: a\u2028b A:", "Q: c\u0085d A:", "Q: e\u2029f A:"]
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert [(n, spec.text) for n, spec in read_prompts(path)] == [(1, texts[0]), (2, texts[1]), (3, texts[2])]


def test_crlf_endings_and_a_byte_order_mark_are_read_with_the_right_line_numbers(tmp_path):
    """A file saved by a Windows editor (BOM, CRLF) was refused: "not JSON (Unexpected UTF-8 BOM ...)"."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "Q: 1 + 1 A:"}\r\n\r\n{"question": "\xc3\xa9?"}\r\n{"text": 3}\r\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:4.text: 3 is a int")):
        read_prompts(path)
    path.write_bytes(path.read_bytes().replace(b'{"text": 3}', b""))
    assert [(n, spec.WhichOneof("input")) for n, spec in read_prompts(path)] == [(1, "text"), (3, "question")]


def test_a_call_over_the_servers_batch_limit_names_the_option_that_fixes_it():
    details = "prompts: 256 given, must be 1..64 (prompts.max_batch)"
    assert batch_hint(details) == f"{details}; give --batch at most that"
    assert batch_hint("prompts.max_queued") == "prompts.max_queued"
