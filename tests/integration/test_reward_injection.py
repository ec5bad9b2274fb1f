"""Reward names in injected prompts never reach an import (issue 41, finding 1), on a real Redis and the real ingest
gRPC server: prompts written straight into the run's Redis, as anyone who can reach it could, bypassing
PromptService.Submit, naming `os:system` or a module whose import leaves a file behind. A sampler's group source
claims through the ingest as a sampler does. Nothing is imported, the client sees an error result, the prompt is
not handed out again, and the sampler goes on generating."""

import itertools
import sys
import time
from concurrent import futures

import grpc
import jax
import pytest

from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.common.tasks.arith import build_task
from grpo_stream.common.tasks.task_tokenizer import build_tokenizer
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.client.prompts import PromptClient
from grpo_stream.protos import prompts_pb2, rollout_pb2, rollout_pb2_grpc
from grpo_stream.sampler_service import group_source
from grpo_stream.sampler_service.group_source import GroupSource
from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue
from tests.support import serve, with_run_name

pytestmark = pytest.mark.redis
PLANTED = "grpo_planted_reward_probe"  # a module on sys.path whose import writes a file: the proof of execution


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module `PLANTED` that anyone could import, with a reward-shaped function; its import writes `mark`."""
    mark = tmp_path / "imported"
    (tmp_path / f"{PLANTED}.py").write_text(f"import pathlib\npathlib.Path({str(mark)!r}).write_text('ran')\n"
                                            "def run(text, reference):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(PLANTED, None)
    yield mark
    sys.modules.pop(PLANTED, None)


@pytest.fixture
def stack(small_cfg, shared_redis, run_name, tmp_path):
    task = build_task(small_cfg)
    tokenizer = build_tokenizer(small_cfg, task)
    with serve(with_run_name(small_cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as s:
        yield s, task, tokenizer


def plant_prompt(queue: PromptQueue, pid: str, rewards: list[str], client: str = "client") -> None:
    """An injected prompt laid out in Redis as Submit's script writes one, with none of Submit's checks."""
    req = rollout_pb2.InjectedPrompt(prompt_id=pid, prompt_token_ids=[3, 4, 5], reference_answer="5",
                                     rewards=rewards, num_generations=4, train=False)
    spec = prompts_pb2.PromptSpec(text="Q: 2 + 3 A:", reference_answer="5", rewards=rewards)
    score = 1 + int(pid.rsplit("-", 1)[-1])
    queue.client.hset(queue.prompt_key(pid), mapping={
        "req": req.SerializeToString(), "spec": spec.SerializeToString(), "client": client, "state": "queued",
        "train": "0", "score": score, "submitted": time.time(), "tags": "[]"})
    queue.client.zadd(queue.queue, {pid: score})
    queue.client.hincrby(queue.pending, client, 1)


@pytest.fixture(autouse=True)
def claim_every_time(monkeypatch):
    monkeypatch.setattr(group_source, "CLAIM_EVERY_S", 0.0)  # every call may claim (the tests do not wait it out)


def sampler(cfg, task, tokenizer, channel) -> GroupSource:
    """Sampler 0's group source (loop.py's, without an engine), claiming through the ingest over gRPC."""
    stream = zip(itertools.count(), task.train_stream(0, 1))
    builder = GroupSource(cfg, "sampler-0", tokenizer, stream, RewardSet(cfg.task.rewards), jax.random.key(0))
    builder.ingest_stub = rollout_pb2_grpc.RolloutIngestStub(channel)
    return builder


def next_groups(builder, groups: int, version: int):
    return builder.next_groups(groups, groups * builder.cfg.generation.num_generations, version)


def test_prompts_in_redis_naming_import_paths_are_refused_and_nothing_is_imported(stack, planted):
    s, task, tokenizer = stack
    queue = PromptQueue(s.buffer.client, s.cfg.run.name)
    plant_prompt(queue, "p-evil-1", [f"{PLANTED}:run"])
    plant_prompt(queue, "p-os-2", ["answer_format", "os:system"])
    plant_prompt(queue, "p-ok-3", ["answer_format"])
    builder = sampler(s.cfg, task, tokenizer, s.channel("sampler"))
    g = s.cfg.generation.num_generations

    batch = next_groups(builder, 3, 0)
    assert not planted.exists() and PLANTED not in sys.modules  # nothing imported, nothing ran
    injected = [slot for slot in batch if slot.injected]
    assert [slot.problem.prompt_id for slot in injected] == ["p-ok-3"]  # the valid one is generated as before
    assert len(batch) == 3 and all(slot.rows == g for slot in batch[1:])  # dataset prompts fill the rest

    # its client sees each refused prompt as finished, with an error naming the field and the allowed names
    with PromptClient(s.address, ClientSecurity(s.token("client"))) as client:
        results = {r.prompt_id: r for r in client.results(["p-evil-1", "p-os-2"], timeout_s=10)}
    assert {r.state for r in results.values()} == {"cancelled"}
    assert results["p-evil-1"].error.startswith(f"rewards[0]: '{PLANTED}:run' is not one of this run's rewards ")
    assert results["p-os-2"].error.startswith("rewards[1]: 'os:system' is not one of this run's rewards ")
    assert "answer_correct" in results["p-os-2"].error and "answer_format" in results["p-os-2"].error
    # finished for good: in neither the queue nor the claimed set (the claim lease never brings them back), and
    # the client's quota is released
    assert queue.client.zscore(queue.claimed, "p-evil-1") is None and queue.client.zcard(queue.queue) == 0
    assert queue.client.hget(queue.pending, "client") == b"1"  # p-ok-3, claimed and not answered yet
    assert queue.counts() == (0, 1)

    # the sampler goes on: the next batches are dataset prompts, and a later claim hands out nothing refused
    assert all(not slot.injected for slot in next_groups(builder, 2, 1))
    assert not planted.exists() and PLANTED not in sys.modules


class UncheckedIngest(rollout_pb2_grpc.RolloutIngestServicer):
    """An ingest that hands out whatever it holds (an older version that checked nothing, or one whose
    task.rewards names more than the sampler's)."""

    def __init__(self, prompts):
        self.prompts = list(prompts)

    def ClaimPrompts(self, request, context):
        handed, self.prompts = self.prompts, []
        return rollout_pb2.ClaimedPrompts(prompts=handed)


def test_a_sampler_skips_a_name_outside_its_config_even_when_an_ingest_hands_it_out(small_cfg, planted, caplog):
    task = build_task(small_cfg)
    tokenizer = build_tokenizer(small_cfg, task)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutIngestServicer_to_server(UncheckedIngest([
        rollout_pb2.InjectedPrompt(prompt_id="p-evil", prompt_token_ids=[3, 4, 5], reference_answer="5",
                                   rewards=[f"{PLANTED}:run"], num_generations=4)]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            builder = sampler(small_cfg, task, tokenizer, channel)
            batch = next_groups(builder, 2, 0)
            assert not planted.exists() and PLANTED not in sys.modules
            assert all(not slot.injected for slot in batch) and builder.injected_refused == 1
            assert "'p-evil' not generated: rewards[0]" in caplog.text
            assert all(not slot.injected for slot in next_groups(builder, 2, 1))  # goes on
    finally:
        server.stop(0)
