"""A background publication that never ends fails the next step with an error naming it, after
BACKGROUND_WAIT_S (shortened here); before, it raised a TimeoutError with no message at all."""

import threading

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service import core as core_module
from grpo_stream.trainer_service.plans import StartPlan
from tests.conftest import CONFIGS
from tests.unit.trainer_service.test_trainer_core import SMALL_CORE, batches, new_core, step


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIGS / "tiny_arith.yaml", [*SMALL_CORE, "trainer.eval_before=false",
                                                     "trainer.eval_after=false"])


@pytest.mark.parametrize("copy", [True, False])
def test_a_stuck_publication_fails_the_next_step_with_an_error_that_names_it(cfg, tmp_path, monkeypatch, copy):
    core, keeper = new_core(cfg.model_copy(update={"weights": cfg.weights.model_copy(update={"publish_copy": copy})}),
                            tmp_path)
    data = batches(cfg, core.parts.tokenizer.vocab_size)
    core.apply(StartPlan(epoch="e", restore=None, warm_start=False, export_warm=False, eval_before=False))
    release, inner = threading.Event(), core.publisher.sink.put

    def stuck_put(version, named, *args, **kwargs):
        if version == 1:
            assert release.wait(120)
        return inner(version, named, *args, **kwargs)

    core.publisher.sink.put = stuck_put
    monkeypatch.setattr(core_module, "BACKGROUND_WAIT_S", 0.5)
    try:
        core.apply(step(1, data[0], publish=True))
        # without weights.publish_copy the update waits for it; with, the step's hand-off does
        with pytest.raises(TimeoutError, match=r"weight publication.* did not end in 0s; check where it writes"):
            core.apply(step(2, data[1]))
    finally:
        release.set()
        keeper.checkpoints.close()
        core.close(failed=True)
