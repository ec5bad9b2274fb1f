"""Clients of a live run: the prompt client, and `grpo-stream submit`, `status` and `tokens`."""
