"""StreamResults against a real Redis, its servicer called directly so the test decides when each result is read:
a follower reads a bounded number of whole records at a time, and a result evicted before it was read is reported,
never skipped."""

import pytest

from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.protos import prompts_pb2
from grpo_stream.trainer_service.ingest import prompt_service
from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue
from grpo_stream.trainer_service.ingest.prompt_service import PromptServicer
from tests.integration.test_prompt_service import claim, clients, prompt_stack
from tests.support import answer

pytestmark = pytest.mark.redis


class FollowContext:
    """A follower's call as the servicer sees it with auth.mode=none (its table is None): active until the test
    stops reading."""

    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


class CountingQueue(PromptQueue):
    """The run's queue, remembering how many whole records each read asked for."""

    reads: list[int]

    def records(self, prompt_ids):
        self.reads.append(len(prompt_ids))
        return super().records(prompt_ids)


def direct_servicer(stack, tiny_parts, queue_cls=PromptQueue) -> PromptServicer:
    _, task, tokenizer, _ = tiny_parts
    queue = queue_cls(stack.buffer.client, stack.cfg.run.name)
    return PromptServicer(stack.cfg, queue, tokenizer, task, None)


def answer_all(stack, ingest, pids, prompts) -> None:
    for pid in pids:
        ack = ingest.PushGroup(to_proto(answer(prompts[pid], stack.cfg.run.name)))
        assert ack.code == 0, ack.message


def test_a_followed_result_evicted_before_it_is_read_is_reported_not_skipped(tiny_parts, shared_redis, run_name,
                                                                              tmp_path):
    """A result that left Redis (prompts.max_kept_results newer ones finished) between its finish and the
    follower's read was dropped without a word: the stream ended as if complete, one prompt short."""
    with prompt_stack(tiny_parts, shared_redis.url, run_name, tmp_path, max_kept_results=1,
                      max_injected_fraction=1.0) as stack:
        client, ingest = clients(stack)
        ids = client.submit([{"text": f"Q: {i} A:"} for i in range(3)])
        prompts = {p.prompt_id: p for p in claim(ingest, "sampler-0", n=3)}
        answer_all(stack, ingest, ids[:1], prompts)
        stream = direct_servicer(stack, tiny_parts).StreamResults(prompts_pb2.ResultsRequest(prompt_ids=ids),
                                                                  FollowContext())
        assert next(stream).prompt_id == ids[0]
        answer_all(stack, ingest, ids[1:], prompts)  # the last one's finish evicts the one before it
        rest = list(stream)
        assert [r.prompt_id for r in rest] == ids[1:]
        gone, last = rest
        assert "prompts.max_kept_results" in gone.error and not gone.completions and gone.policy_version == -1
        assert last.state == "done" and not last.error and len(last.completions) == prompts[ids[2]].num_generations


def test_a_tag_follower_reads_whole_records_a_chunk_at_a_time(tiny_parts, shared_redis, run_name, tmp_path,
                                                              monkeypatch):
    """Each record holds its whole answer group (a real model's: num_generations x completion tokens); a tag's or
    an id list's followers read every one whole before their first result, so a few calls over a tag with
    prompts.max_kept_results results could take the trainer's memory."""
    monkeypatch.setattr(prompt_service, "RECORDS_AT_ONCE", 2)
    with prompt_stack(tiny_parts, shared_redis.url, run_name, tmp_path, max_injected_fraction=1.0) as stack:
        client, ingest = clients(stack)
        ids = client.submit([{"text": f"Q: {i} A:", "tags": ["many"]} for i in range(5)])
        prompts = {p.prompt_id: p for p in claim(ingest, "sampler-0", n=5)}
        answer_all(stack, ingest, ids[::-1], prompts)  # finished last to first: a tag's results come in that order
        servicer = direct_servicer(stack, tiny_parts, CountingQueue)
        for request in (prompts_pb2.ResultsRequest(tag="many"), prompts_pb2.ResultsRequest(prompt_ids=ids)):
            servicer.queue.reads = []
            results = list(servicer.StreamResults(request, FollowContext()))
            assert sorted(r.prompt_id for r in results) == sorted(ids)
            assert all(r.state == "done" and len(r.completions) == prompts[r.prompt_id].num_generations
                       for r in results)
            assert servicer.queue.reads and max(servicer.queue.reads) <= 2, servicer.queue.reads
        tagged = list(servicer.StreamResults(prompts_pb2.ResultsRequest(tag="many"), FollowContext()))
        assert [r.prompt_id for r in tagged] == ids[::-1]  # oldest finish first, as before
