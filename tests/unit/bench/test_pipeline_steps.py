"""bench pipeline (and bench evaluation, which runs it) refuses a step count that leaves nothing to time."""

import pytest

from grpo_stream.bench import pipeline


@pytest.mark.parametrize("steps, alternate, least", [(4, False, 5), (11, True, 12)])
def test_too_few_steps_are_refused_before_the_trainer_runs(monkeypatch, steps, alternate, least):
    """With steps at most the warm-up, the whole trainer run happened and then figures() divided by zero; alternating,
    one mode could get no step of its own."""
    monkeypatch.setattr(pipeline, "_run_trainer", lambda *a, **k: pytest.fail("the trainer ran"))
    with pytest.raises(ValueError, match=f"steps={steps}: .* give at least {least}"):
        pipeline.run(quick=True, steps=steps, alternate=alternate)
