"""What a process builds from its config, above the tasks and the model: the run's task and tokenizer, its policy
model (parts.py), and JAX's persistent compilation cache (compilation_cache.py). Entry points call these after the
config parsed."""
