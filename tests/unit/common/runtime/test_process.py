"""Process start-up: readable log lines by default, one JSON object per line on request; no torch import."""

import json
import logging
import subprocess
import sys

import pytest

from grpo_stream.common.runtime.process import setup_logging
from tests.conftest import ROOT


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


def test_pin_to_cpus_restricts_this_process_and_restores():
    import os

    from grpo_stream.common.runtime.process import pin_to_cpus

    before = os.sched_getaffinity(0)
    first = min(before)
    try:
        pin_to_cpus([first], "trainer.cpu_affinity")
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, before)
    pin_to_cpus(None, "trainer.cpu_affinity")  # null leaves the process alone
    assert os.sched_getaffinity(0) == before


def test_pin_to_unavailable_core_names_the_field():
    import os

    from grpo_stream.common.runtime.process import pin_to_cpus

    before = os.sched_getaffinity(0)
    missing = max(before) + 64
    with pytest.raises(ValueError, match=rf"sampler.cpu_affinity=\[{missing}\].*not available"):
        pin_to_cpus([missing], "sampler.cpu_affinity")
    assert os.sched_getaffinity(0) == before


# Service processes start without importing torch (tensorboardX would pull it in, 1.5-4 s a start), and torch
# stays importable afterwards for code that needs it.
def test_tunix_models_load_without_torch_and_torch_still_imports():
    code = ("import sys\n"
            "from grpo_stream.common.runtime.process import import_tensorboardx_without_torch\n"
            "import_tensorboardx_without_torch()\n"
            "from tunix.models.qwen3 import model\n"
            "import tensorboardX\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "import torch\n"
            "print('torch', torch.__version__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("torch "), proc.stderr[-2000:]
