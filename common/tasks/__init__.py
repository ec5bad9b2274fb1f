"""Tasks: prompt sources, reference answers and reward functions."""
