"""Trainer checkpoints (store.py: Orbax saves, verified on restore; digest.py: their files' SHA-256s; errors.py:
what a restore can conclude) and exactly-once training across crashes (durability.py)."""
