"""A sampler whose stream has room for more groups than one request may carry asks for what the ingest takes.

generation.decode_slots=10000 with num_generations=2 is a valid setting (a small model on a large accelerator), and
the feeder's room for groups is then up to 5000 (`Sampler._feed`: rows free // num_generations). The ingest takes at
most 4096 groups in one Admit and 4096 prompts in one ClaimPrompts, and refuses more with INVALID_ARGUMENT: the
Admit refusal, which no retry changes, stopped the sampler for good with a PermanentError at its first feed; the claim
refusal left every injected prompt unclaimed for the run (a warning, once). Against the real trainer server (ingest,
admission control and PromptService on a real Redis)."""

import itertools
import threading

import jax
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc, rollout_pb2_grpc
from grpo_stream.sampler_service.admission_client import AdmissionClient
from grpo_stream.sampler_service.group_source import GroupSource
from tests.conftest import CONFIGS
from tests.support import serve

pytestmark = pytest.mark.redis


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    """A trainer server for a sampler with room for 5000 groups at once; yields (stack, cfg, task, tokenizer)."""
    _, task, tokenizer, _ = tiny_parts
    cfg = load_config(CONFIGS / "tiny_arith.yaml", [
        f"run.name={run_name}", "generation.decode_slots=10000", "generation.num_generations=2",
        "sampler.rows_in_flight=10000", "trainer.max_staleness=1000", "prompts.max_injected_fraction=1.0"])
    with serve(cfg, shared_redis.url, tmp_path / "auth", task, tokenizer) as s:
        yield s, cfg, task, tokenizer


def groups_room(cfg) -> int:
    """The most groups the feeder wants in one feed: its stream's rows, all free, in groups."""
    return min(cfg.rows_in_flight(), cfg.engine_slots()[1]) // cfg.generation.num_generations


def test_admission_for_more_groups_than_one_request_carries_is_granted_not_refused_for_good(stack):
    s, cfg, _, _ = stack
    wanted = groups_room(cfg)
    assert wanted > 4096  # what the feeder asks for with these settings
    admission = AdmissionClient(rollout_pb2_grpc.RolloutIngestStub(s.channel("sampler")), "sampler-0", True,
                                threading.Event())
    granted = admission.admit(wanted, version=0, in_flight=0)  # raised PermanentError (INVALID_ARGUMENT)
    assert 0 < granted <= wanted and admission.refusals == 0


def test_injected_prompts_are_claimed_by_a_sampler_with_room_for_more_than_one_claim_carries(stack, caplog):
    s, cfg, task, tokenizer = stack
    client = prompts_pb2_grpc.PromptServiceStub(s.channel("client"))
    ids = set(client.Submit(prompts_pb2.SubmitRequest(prompts=[
        prompts_pb2.PromptSpec(text=f"Q: probe {i} A:") for i in range(3)])).prompt_ids)
    source = GroupSource(cfg, "sampler-0", tokenizer, zip(itertools.count(), task.train_stream(0, 1)),
                         RewardSet(cfg.task.rewards), jax.random.key(0))
    source.ingest_stub = rollout_pb2_grpc.RolloutIngestStub(s.channel("sampler"))
    wanted = groups_room(cfg)
    works = source.next_groups(wanted, wanted * cfg.generation.num_generations, version=0)
    # the claim was refused (INVALID_ARGUMENT, warned once): dataset prompts took every row, the probes none
    assert {w.problem.prompt_id for w in works if w.injected} == ids, caplog.text[-2000:]
    assert "cannot claim injected prompts" not in caplog.text
