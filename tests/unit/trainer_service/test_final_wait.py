"""The trainer's wait for samplers at the end of a run: done when every sampler it should have (sampler.replicas)
installed the final version, not merely every sampler that has reported to it. A restarted trainer knows only the
samplers that reported since; one still backing off from the restart would otherwise never be told to stop."""

import threading
import time
import types

from grpo_stream.trainer_service.plan_sources import await_samplers
from grpo_stream.trainer_service.publication.samplers import SamplerRegistry


def waiter(replicas: int, final_wait_s: float = 5.0):
    cfg = types.SimpleNamespace(sampler=types.SimpleNamespace(replicas=replicas),
                                trainer=types.SimpleNamespace(final_wait_s=final_wait_s))
    return types.SimpleNamespace(cfg=cfg, samplers=SamplerRegistry(), stop_event=threading.Event())


def test_the_wait_ends_only_when_every_replica_is_at_the_final_version():
    trainer = waiter(replicas=2)
    trainer.samplers.record("sampler-1", 24)  # the one sampler that reported since the restart
    late = threading.Timer(1.0, lambda: trainer.samplers.record("sampler-0", 24))  # back from its back-off
    late.start()
    started = time.monotonic()
    await_samplers(trainer.cfg, trainer.samplers, trainer.stop_event, 24)
    waited = time.monotonic() - started
    assert 0.9 <= waited < 4.0, waited  # it waited for sampler-0, and no longer


def test_a_sampler_that_never_comes_back_is_waited_for_final_wait_s_only():
    trainer = waiter(replicas=2, final_wait_s=0.6)
    trainer.samplers.record("sampler-1", 24)
    started = time.monotonic()
    await_samplers(trainer.cfg, trainer.samplers, trainer.stop_event, 24)
    assert 0.6 <= time.monotonic() - started < 3.0


def test_a_stop_ends_the_wait_and_says_so_rather_than_claim_final_wait_s_passed(caplog):
    trainer = waiter(replicas=1, final_wait_s=600.0)
    trainer.stop_event.set()  # SIGTERM during the last step: the finish plan is applied, the wait is not made
    with caplog.at_level("INFO", logger="grpo_stream.trainer_service.plan_sources"):
        await_samplers(trainer.cfg, trainer.samplers, trainer.stop_event, 24)
    said = [r.getMessage() for r in caplog.records]
    assert not any("after 600s" in line for line in said), said
    assert any("stopping" in line and "final version 24" in line for line in said), said
