"""What `grpo-stream submit` and PromptClient say about a prompt line protobuf cannot hold: the key, not a bare
protobuf message that names none."""

import json
import re

import pytest

from grpo_stream.client.prompts import to_spec


@pytest.mark.parametrize("line, message", [
    ('{"text": "x", "num_generations": 1099511627776}', "f.jsonl:3.num_generations: 1099511627776 is outside a 32-bit"),
    ('{"text": "x", "priority": -4294967296}', "f.jsonl:3.priority: -4294967296 is outside a 32-bit"),
    ('{"text": "a\\ud800b"}', "f.jsonl:3.text: character 1 is a lone UTF-16 surrogate"),
    ('{"question": "q", "tags": ["ok", "\\udfff"]}', "f.jsonl:3.tags[1]: character 0 is a lone UTF-16 surrogate"),
    ('{"text": "x", "answer": NaN}', "f.jsonl:3.answer: nan is not a finite number"),
    ('{"text": "x", "reference_answer": 1e400}', "f.jsonl:3.reference_answer: inf is not a finite number"),
])
def test_a_value_protobuf_cannot_hold_is_refused_naming_its_key(line, message):
    """Before: "f.jsonl:3: Value out of range: 1099511627776" and "'utf-8' codec can't encode character", naming no
    key; and NaN went to the run as the reference answer "nan"."""
    with pytest.raises(ValueError, match=re.escape(message)):
        to_spec(json.loads(line), "f.jsonl:3")


def test_numbers_that_fit_are_kept():
    spec = to_spec({"question": "q", "answer": 12345678901234567890, "num_generations": 4, "priority": 2,
                    "tags": ["é"]})
    assert (spec.reference_answer, spec.num_generations, spec.priority, list(spec.tags)) == (
        "12345678901234567890", 4, 2, ["é"])


def test_answer_and_reference_answer_together_are_refused():
    """Both are one field: `reference_answer` won and `answer` was dropped without a word."""
    with pytest.raises(ValueError, match=re.escape("f.jsonl:3: give `answer` or `reference_answer`")):
        to_spec({"text": "x", "answer": "5", "reference_answer": "6"}, "f.jsonl:3")
