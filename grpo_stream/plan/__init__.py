"""Sizing a run before it runs: memory per device (`grpo-stream plan`) and the device layout (`grpo-stream devices`)."""
