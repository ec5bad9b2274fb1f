"""The run config: strict pydantic sections (schema.py), secrets and access (access.py), field descriptions (describe.py)."""
