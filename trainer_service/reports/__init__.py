"""What a trainer run reports: the tracker interface and its backends (metrics.py, wandb_tracker.py), each step's
report (step_report.py), and what a run leaves behind besides checkpoints (run_outputs.py: evaluations, the exported
model, summary.json)."""
