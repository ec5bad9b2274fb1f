"""The policy model: Tunix architectures, Hugging Face checkpoints, tokenizers, device meshes and sharding."""
