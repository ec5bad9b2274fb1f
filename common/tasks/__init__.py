"""Tasks (arithmetic, GSM8K), prompt rendering, answer parsing and reward functions."""
