"""The run config: RunConfig and the deployment sections (schema.py), what is learned and how (learning.py),
process sections (process.py), reading files and overrides (loading.py), secrets and access (access.py), field
descriptions (describe.py)."""
