"""`grpo-stream audit RUN_DIR` on a run file (RUN_DIR/run.json) that is cut short or lacks its fields: a message
naming the file and exit 2 (could not judge), never a KeyError's exit 1, which means groups were lost."""

import json

import pytest

from grpo_stream.cli import exit_code
from grpo_stream.commands import COMMANDS
from grpo_stream.common.rollouts.buffer import RUN_FILE
from grpo_stream.reports.audit import run_audit


@pytest.mark.parametrize("text, why", [('{"run": "r", "redis', "not JSON"), ('{"run": "r"}', "no \"run\" and"),
                                       ("[]", "no \"run\" and"), ('{"run": 3, "redis_url": "redis://x"}', "no")])
def test_a_damaged_run_file_is_named_and_exits_2(tmp_path, text, why):
    (tmp_path / RUN_FILE).write_text(text)
    with pytest.raises(ValueError, match=why) as raised:
        run_audit(tmp_path, None, None, None)
    assert str(tmp_path / RUN_FILE) in str(raised.value)
    assert exit_code(raised.value, COMMANDS["audit"])[0] == 2


def test_a_sound_run_file_gets_past_reading(tmp_path):
    """The check refuses nothing the trainer writes: with a sound file the audit goes on to reach the Redis."""
    (tmp_path / RUN_FILE).write_text(json.dumps({"run": "r", "redis_url": "redis://127.0.0.1:1/0"}))
    with pytest.raises(Exception) as raised:
        run_audit(tmp_path, None, None, None)
    assert str(tmp_path / RUN_FILE) not in str(raised.value)
