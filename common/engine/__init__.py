"""Generation engines (the GenerationEngine interface in base.py, chosen in common/registry/engines.py) and held-out evaluation."""
