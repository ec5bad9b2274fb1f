"""Process set-up: logging and console verbosity, the compilation cache, CPU pinning, Prometheus, building task, tokenizer and policy from a config."""
