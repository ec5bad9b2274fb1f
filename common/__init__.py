"""Code the trainer and sampler services share (they never import each other). See ARCHITECTURE.md."""
