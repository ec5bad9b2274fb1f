"""Generation engines (the GenerationEngine interface in base.py, chosen in registry.py) and held-out evaluation."""
