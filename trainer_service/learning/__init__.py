"""What the trainer learns and how: a step's groups from the buffer (collector.py, selection.py), batches and their
packing, advantages, the loss, the RL update and its compiled programs, the optimizer, the supervised warm start,
what is trained (params_policy.py) and the off-policy diagnostics."""
