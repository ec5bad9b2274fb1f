"""`grpo-stream up`: a whole run on one machine, as supervised processes (`run.py`) or in one process
(`colocated.py`)."""
