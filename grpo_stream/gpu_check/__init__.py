"""The whole loop proved on one GPU, phase by phase (`scripts/gpu-check.sh`; `python -m grpo_stream.gpu_check`)."""
