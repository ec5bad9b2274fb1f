"""What a run or a model did: `grpo-stream audit`, `report`, `eval`, and the TPU smoke check's result file."""
