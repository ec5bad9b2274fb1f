"""The restart policy `up` applies: jittered, growing waits per process, a cap on restarts, 'never'."""

from grpo_stream.common.config.process import UpSection
from grpo_stream.supervise import Supervisor


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_process_restarts_after_a_growing_wait_until_its_cap():
    clock = Clock()
    sup = Supervisor(UpSection(max_restarts=3, restart_backoff_s=1.0), clock)
    waits = []
    for _ in range(3):
        delay = sup.failed("sampler-0")
        waits.append(delay)
        assert sup.waiting("sampler-0") and sup.due() == []  # not before its time
        clock.now += delay
        assert sup.due() == ["sampler-0"] and not sup.waiting("sampler-0")
    assert 0.5 <= waits[0] <= 1.0 and 1.0 <= waits[1] <= 2.0 and 2.0 <= waits[2] <= 4.0
    assert sup.restarts["sampler-0"] == 3
    assert sup.failed("sampler-0") is None  # a fourth failure stops the run
    assert sup.failed("trainer") is not None and sup.restarts["trainer"] == 0  # counts are per process


def test_never_restarts_nothing():
    sup = Supervisor(UpSection(restart="never"), Clock())
    assert sup.failed("trainer") is None and sup.due() == []
