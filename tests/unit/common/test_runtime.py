"""Process logging: readable lines by default, one JSON object per line on request."""

import json
import logging

import pytest

from common.runtime import setup_logging


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_logs_are_one_object_per_line_with_exceptions(capsys):
    setup_logging("INFO", "trainer", "json")
    log = logging.getLogger("grpo_stream.test")
    log.info("step %d/%d done", 3, 10)
    try:
        raise ValueError("bad batch")
    except ValueError:
        log.exception("update failed")
    logging.getLogger("grpo_stream.test").debug("not shown at INFO")
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 2
    assert records[0]["message"] == "step 3/10 done" and records[0]["process"] == "trainer"
    assert records[0]["level"] == "INFO" and records[0]["logger"] == "grpo_stream.test"
    assert records[0]["time"].endswith("+00:00")
    assert records[1]["level"] == "ERROR" and "ValueError: bad batch" in records[1]["exc"]


def test_text_logs_name_the_process(capsys):
    setup_logging("INFO", "sampler-1")
    logging.getLogger("grpo_stream.test").warning("backlog full")
    (line,) = capsys.readouterr().out.splitlines()
    assert " sampler-1 WARNING grpo_stream.test: backlog full" in line
