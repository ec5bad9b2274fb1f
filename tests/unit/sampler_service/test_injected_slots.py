"""How a sampler fills a generation batch with injected prompts: claimed ones first, in order, each with its own
size and rewards; one that does not fit the rows left waits for the next batch; an unreachable ingest only means
dataset prompts."""

import grpc

from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.protos import rollout_pb2
from grpo_stream.sampler_service.loop import Sampler


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class FakeIngest:
    def __init__(self, batches, fail=False):
        self.batches, self.fail, self.asked = list(batches), fail, []

    def ClaimPrompts(self, request, timeout):
        self.asked.append(request.max_prompts)
        if self.fail:
            raise Unavailable()
        return rollout_pb2.ClaimedPrompts(prompts=self.batches.pop(0) if self.batches else [])


def prompt(pid, n, rewards=()):
    return rollout_pb2.InjectedPrompt(prompt_id=pid, prompt_token_ids=[1, 2, 3], reference_answer="5",
                                      rewards=list(rewards), num_generations=n, train=False)


def test_injected_prompts_fill_rows_in_order_and_the_rest_waits(small_cfg):
    sampler = Sampler(small_cfg, 0)
    default = RewardSet(small_cfg.task.rewards)
    sampler.ingest_stub = FakeIngest([[prompt("a", 4), prompt("b", 2, ["answer_format"]), prompt("c", 16)]])
    slots = sampler._injected_slots(free_rows=12, default=default)
    assert [(s.problem.prompt_id, s.rows, s.position) for s in slots] == [("a", 4, None), ("b", 2, None)]
    assert slots[0].group_id == f"{small_cfg.run.name}/inj/a"
    assert slots[0].rewards is default and set(slots[1].rewards.weights) == {"answer_correct", "answer_format"}
    assert [p.prompt_id for p in sampler.pending] == ["c"]  # 16 rows do not fit the 6 left
    assert sampler.ingest_stub.asked == [small_cfg.sampler.prompts_per_batch]
    slots = sampler._injected_slots(free_rows=32, default=default)
    assert [s.problem.prompt_id for s in slots] == ["c"]


def test_an_unreachable_ingest_leaves_the_batch_to_dataset_prompts(small_cfg):
    sampler = Sampler(small_cfg, 0)
    sampler.ingest_stub = FakeIngest([], fail=True)
    assert sampler._injected_slots(free_rows=32, default=RewardSet(small_cfg.task.rewards)) == []
