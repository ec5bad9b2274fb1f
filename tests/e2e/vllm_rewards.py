"""A reward for the vLLM end-to-end test: longer completions score higher. A random model's completions vary
in length, so groups have reward variance and a few GRPO steps visibly move the weights (the arith rewards
are all zero for a random model, which would leave the weights where they started), and the policy is
pushed away from stopping at once, so its greedy completions stay non-empty and worth comparing."""


def longer_is_better(text: str, reference: str) -> float:
    del reference
    return len(text) / 40.0
