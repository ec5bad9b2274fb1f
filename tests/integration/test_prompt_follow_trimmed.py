"""A follower of prompt ids that falls behind the results stream, on a real Redis: the stream keeps about
prompts.max_kept_results finishes, so one it had not read yet can be trimmed before it reads it."""

import threading

import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.protos import prompts_pb2
from grpo_stream.trainer_service.ingest.server import ingest_servicers
from tests.support import AbortingContext, wait_for, with_run_name

pytestmark = pytest.mark.redis


class Context(AbortingContext):
    active = True

    def is_active(self) -> bool:
        return self.active


def test_a_finish_trimmed_before_the_follower_read_it_is_reported_not_waited_for(tiny_parts, shared_redis, run_name):
    """The follower read the stream from where it stopped: a finish trimmed meanwhile never came, and it waited for
    that prompt for ever (its record gone too). Now it asks the records of what it waits for, and says it is gone."""
    cfg, task, tokenizer, _ = tiny_parts
    cfg = with_run_name(cfg, run_name)
    cfg = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"max_kept_results": 1})})
    _, prompts = ingest_servicers(cfg, RedisStreamBuffer(connect(shared_redis.url, 5), run_name), task, tokenizer,
                                  None)
    context, queue = Context(), prompts.queue

    def submit(n: int) -> list[str]:
        specs = [prompts_pb2.PromptSpec(text=f"Q: {i} A:") for i in range(n)]
        return list(prompts.Submit(prompts_pb2.SubmitRequest(prompts=specs), context).prompt_ids)

    followed, unfinished = submit(1), submit(1)
    read, polls = queue.wait_finished, []
    resume = threading.Event()

    def behind(after, block_ms):  # the follower's first read comes late (a slow reader holds it in its send)
        polls.append(after)
        if len(polls) == 1:
            resume.wait(60)
        return read(after, block_ms)

    queue.wait_finished = behind
    got = []
    request = prompts_pb2.ResultsRequest(prompt_ids=followed + unfinished, follow=True)
    follower = threading.Thread(target=lambda: got.extend(prompts.StreamResults(request, context)))
    follower.start()
    try:
        wait_for(lambda: polls, 30, "the follower to wait for finishes")
        prompts.Cancel(prompts_pb2.CancelRequest(prompt_ids=followed), context)
        for _ in range(3):  # enough finishes after it that the stream drops its entry
            prompts.Cancel(prompts_pb2.CancelRequest(prompt_ids=submit(100)), context)
        assert queue.client.xlen(queue.results) < 300
        resume.set()
        wait_for(lambda: got, 30, "the followed prompt's result")
        [result] = got
        assert result.prompt_id == followed[0] and "left Redis before this stream read it" in result.error
        # the unfinished prompt is still followed, and reported when it finishes
        prompts.Cancel(prompts_pb2.CancelRequest(prompt_ids=unfinished), context)
        follower.join(30)
        assert not follower.is_alive()
        assert [r.prompt_id for r in got] == followed + unfinished and got[1].state == "cancelled"
    finally:
        context.active = False
        resume.set()
        follower.join(30)


def test_a_prompt_finishing_after_its_tags_set_expired_is_found_by_its_tag(tiny_parts, shared_redis, run_name):
    """A tag's set expires prompts.result_retention_s after its last submit: a prompt that waited in the queue
    longer finished into no set (the finish only renewed the expiry of a set that was gone), and `results --tag`
    never found it."""
    cfg, task, tokenizer, _ = tiny_parts
    _, prompts = ingest_servicers(with_run_name(cfg, run_name), RedisStreamBuffer(connect(shared_redis.url, 5),
                                                                                   run_name), task, tokenizer, None)
    context, queue = Context(), prompts.queue
    spec = prompts_pb2.PromptSpec(text="Q: 1 A:", tags=["slow"])
    [pid] = prompts.Submit(prompts_pb2.SubmitRequest(prompts=[spec]), context).prompt_ids
    queue.client.delete(f"{queue.base}:tag:slow")  # what its expiry does while the prompt waits in the queue
    prompts.Cancel(prompts_pb2.CancelRequest(prompt_ids=[pid]), context)
    assert queue.tagged("slow") == [pid]
    assert 0 < queue.client.ttl(f"{queue.base}:tag:slow") <= cfg.prompts.result_retention_s
    found = list(prompts.StreamResults(prompts_pb2.ResultsRequest(tag="slow"), context))
    assert [r.prompt_id for r in found] == [pid] and found[0].state == "cancelled"
    # a tag key something else rewrote as another type is left alone: the finish itself goes through
    [other] = prompts.Submit(prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(text="Q: 2 A:", tags=["odd"])]),
                             context).prompt_ids
    queue.client.set(f"{queue.base}:tag:odd", "not a set")
    assert list(prompts.Cancel(prompts_pb2.CancelRequest(prompt_ids=[other]), context).cancelled) == [other]
    assert queue.client.get(f"{queue.base}:tag:odd") == b"not a set"
