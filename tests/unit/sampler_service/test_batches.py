"""How a sampler fills a generation batch: claimed injected prompts first, in order, each with its own size and
rewards; one that does not fit the rows left waits for the next batch; dataset prompts fill the rest in stream
order, named and seeded by their data position; over-long prompts are skipped, and a stream of nothing but
over-long prompts is a config error that names the field; an unreachable ingest only means dataset prompts."""

import itertools
import types

import grpc
import pytest

from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.protos import rollout_pb2
from grpo_stream.sampler_service import batches
from grpo_stream.sampler_service.batches import BatchBuilder


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class FakeIngest:
    def __init__(self, claims, fail=False):
        self.claims, self.fail, self.asked = list(claims), fail, []

    def ClaimPrompts(self, request, timeout):
        self.asked.append((request.max_prompts, request.policy_version))
        if self.fail:
            raise Unavailable()
        return rollout_pb2.ClaimedPrompts(prompts=self.claims.pop(0) if self.claims else [])


class WordTokenizer:
    def encode(self, text):
        return [len(word) for word in text.split()]


def prompt(pid, n, rewards=()):
    return rollout_pb2.InjectedPrompt(prompt_id=pid, prompt_token_ids=[1, 2, 3], reference_answer="5",
                                      rewards=list(rewards), num_generations=n, train=False)


def stream(texts):
    problems = (types.SimpleNamespace(prompt_id=f"p{i}", prompt=t, answer="1") for i, t in enumerate(texts))
    return zip(itertools.count(100), problems)


def builder(cfg, texts=(), claims=(), fail=False):
    b = BatchBuilder(cfg, "sampler-0", WordTokenizer(), stream(itertools.cycle(texts) if texts else iter(())),
                     RewardSet(cfg.task.rewards))
    b.ingest_stub = FakeIngest(claims, fail)
    return b


def test_injected_prompts_fill_rows_in_order_and_the_rest_waits(small_cfg):
    b = builder(small_cfg, claims=[[prompt("a", 4), prompt("b", 2, ["answer_format"]), prompt("c", 16)]])
    slots = b.injected_slots(free_rows=12, version=3)
    assert [(s.problem.prompt_id, s.rows, s.position) for s in slots] == [("a", 4, None), ("b", 2, None)]
    assert slots[0].group_id == f"{small_cfg.run.name}/inj/a"
    assert slots[0].rewards is b.default and set(slots[1].rewards.weights) == {"answer_correct", "answer_format"}
    assert [p.prompt_id for p in b.pending] == ["c"]  # 16 rows do not fit the 6 left
    assert b.ingest_stub.asked == [(small_cfg.sampler.prompts_per_batch, 3)]
    slots = b.injected_slots(free_rows=32, version=3)
    assert [s.problem.prompt_id for s in slots] == ["c"] and b.injected_done == 3


def test_dataset_prompts_fill_the_rows_injected_ones_leave_in_stream_order(small_cfg):
    g = small_cfg.generation.num_generations
    b = builder(small_cfg, texts=["one two", "three four five"], claims=[[prompt("a", g)]])
    batch = b.next_batch(groups=3, version=0)
    assert [s.position for s in batch] == [None, 100, 101]
    assert [s.group_id for s in batch[1:]] == [f"{small_cfg.run.name}/sampler-0/100",
                                               f"{small_cfg.run.name}/sampler-0/101"]
    assert batch[2].ids == [5, 4, 4] and all(s.rows == g for s in batch)
    assert [s.position for s in b.next_batch(groups=2, version=0)] == [102, 103]  # the stream goes on


def test_over_long_prompts_are_skipped_and_a_stream_of_only_those_is_a_config_error(small_cfg, monkeypatch):
    limit = small_cfg.generation.max_prompt_tokens
    b = builder(small_cfg, texts=["x " * (limit + 1), "short one"], fail=True)
    assert [s.position for s in b.next_batch(groups=2, version=0)] == [101, 103]
    monkeypatch.setattr(batches, "MAX_SKIPPED_PROMPTS", 5)
    with pytest.raises(ValueError, match="generation.max_prompt_tokens"):
        builder(small_cfg, texts=["x " * (limit + 1)], fail=True).next_batch(groups=1, version=0)


def test_an_unreachable_ingest_leaves_the_batch_to_dataset_prompts(small_cfg):
    b = builder(small_cfg, texts=["a b"], fail=True)
    assert b.injected_slots(free_rows=32, version=0) == []
    assert [s.position for s in b.next_batch(groups=2, version=0)] == [100, 101]
