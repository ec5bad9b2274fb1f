"""Rollout groups on the wire, the rollout buffer (the RolloutBuffer interface, Redis and in-memory backends, registry.py) and the embedded Redis."""
