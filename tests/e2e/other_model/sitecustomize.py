"""Loaded by every Python process started with this folder on PYTHONPATH (test_permanent_failure.py): sampler-0
alone gets $OTHER_MODEL_OVERRIDE appended to its command line, as a user who started that sampler with another
model's settings (another model.path, for an hf model) would have it."""

import os
import sys

_OVERRIDE = os.environ.get("OTHER_MODEL_OVERRIDE")

if _OVERRIDE and "sampler" in sys.argv and "--index" in sys.argv and sys.argv[sys.argv.index("--index") + 1] == "0":
    sys.argv.append(_OVERRIDE)
