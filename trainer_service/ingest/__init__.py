"""The rollout ingest and the prompt service: what `grpo-stream ingest` runs as its own process (ingest/server.py)
and what trainer process 0 serves itself unless ingest.standalone. It imports nothing else of trainer_service, so
the standalone ingest never loads the learning code or JAX's trainer programs."""
