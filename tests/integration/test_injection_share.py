"""A client token cannot starve training (issue 41, finding 7): injected prompts take at most
prompts.max_injected_fraction of a sampler's rows, clients take fair turns at the queue whatever priority one of them
floods at, and a token table entry's max_priority bounds what that token may submit. Against a real Redis, the real
trainer server (ingest + PromptService, with auth) and the sampler's own group source (injected prompts first)."""

import itertools
import types

import grpc
import jax
import pytest
import yaml

from grpo_stream.common.rpc.auth import AuthError, TokenTable, new_token
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from grpo_stream.sampler_service import group_source
from grpo_stream.sampler_service.group_source import GroupSource
from tests.support import answer, serve, with_run_name

pytestmark = pytest.mark.redis
CALLERS = [("flood", "client", None), ("alice", "client", None), ("capped", "client", 2), ("sampler", "sampler", None)]


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    """The server, and a PromptService stub per client token plus the sampler's ingest stub."""
    cfg, task, tokenizer, _ = tiny_parts
    tokens = {name: new_token() for name, _, _ in CALLERS}
    table = tmp_path / "tokens.yaml"
    table.write_text(yaml.safe_dump([{"name": name, "role": role, "token": tokens[name],
                                      **({} if ceiling is None else {"max_priority": ceiling})}
                                     for name, role, ceiling in CALLERS]))
    cfg = cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"mode": "tokens", "tokens_file": str(table)}),
                                 "prompts": cfg.prompts.model_copy(update={"max_pending_per_client": 40})})
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "unused", task, tokenizer) as s:
        stubs = {name: prompts_pb2_grpc.PromptServiceStub(s.channel(None, tokens[name])) for name in tokens}
        stubs["ingest"] = rollout_pb2_grpc.RolloutIngestStub(s.channel(None, tokens["sampler"]))
        yield s, task, tokenizer, stubs


def submit(stub, n: int, priority: int, tag: str) -> list[str]:
    specs = [prompts_pb2.PromptSpec(text=f"Q: {tag} {i} A:", priority=priority) for i in range(n)]
    return list(stub.Submit(prompts_pb2.SubmitRequest(prompts=specs)).prompt_ids)


def test_a_client_flooding_at_max_priority_starves_neither_other_clients_nor_the_dataset(stack, monkeypatch):
    s, task, tokenizer, stubs = stack
    cfg, top = s.cfg, s.cfg.prompts.max_priority
    monkeypatch.setattr(group_source, "CLAIM_EVERY_S", 0.0)  # every refill claims (the test does not wait it out)
    rows = cfg.rows_in_flight()
    source = GroupSource(cfg, "sampler-0", tokenizer, zip(itertools.count(), task.train_stream(0, 1)),
                         RewardSet(cfg.task.rewards), jax.random.key(0))
    source.ingest_stub = stubs["ingest"]
    flooded = submit(stubs["flood"], 40, top, "flood")  # its whole quota, at the highest priority
    alice = set(submit(stubs["alice"], 3, 0, "alice"))
    served, injected_rows = set(), []
    for _ in range(10):  # ten times the sampler's stream fills all the rows it keeps in flight
        works = source.next_groups(rows // cfg.generation.num_generations, rows, version=0)
        injected = [w for w in works if w.injected]
        injected_rows.append(sum(w.rows for w in injected))
        assert sum(w.rows for w in works) == rows
        for work in injected:  # answered: each frees a place in its client's quota
            prompt = types.SimpleNamespace(prompt_id=work.problem.prompt_id, num_generations=work.rows,
                                           prompt_token_ids=work.prompt_ids)
            assert stubs["ingest"].PushGroup(to_proto(answer(prompt, cfg.run.name))).code == 0
            served.add(work.problem.prompt_id)
        room = 40 - (len(flooded) - len(served & set(flooded)))  # keep the flooding client's quota full
        flooded += submit(stubs["flood"], room, top, "flood") if room else []
    # injected prompts (all 4 rows here) took half of the rows every time; dataset prompts the rest
    assert injected_rows == [rows // 2] * 10, injected_rows
    assert alice <= served, "a client at priority 0 must get turns while another floods at the top priority"
    assert len(served & set(flooded)) >= 3 * len(alice)  # the higher priority still takes most turns


def test_a_tokens_max_priority_bounds_what_it_may_submit(stack):
    _, _, _, stubs = stack
    with pytest.raises(grpc.RpcError) as err:
        submit(stubs["capped"], 1, 3, "capped")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[0].priority: 3 above 2, this token's max_priority" in err.value.details()
    assert len(submit(stubs["capped"], 1, 2, "capped")) == 1
    assert len(submit(stubs["flood"], 1, 9, "uncapped")) == 1  # no entry: prompts.max_priority


@pytest.mark.parametrize("ceiling", [-1, "high", 1.5])
def test_a_bad_max_priority_in_the_token_table_names_the_entry(tmp_path, ceiling):
    table = tmp_path / "tokens.yaml"
    table.write_text(yaml.safe_dump([{"name": "c", "role": "client", "token": new_token(), "max_priority": ceiling}]))
    with pytest.raises(AuthError, match=r"entry 0 \(c\): max_priority must be a whole number >= 0"):
        TokenTable.from_file(table)


def test_prompts_queued_by_a_version_without_fair_turns_are_still_claimed(stack):
    """An upgrade keeps what the queue held: prompts in the run-wide queue only (no per-client queue, no turn)
    are moved into the fair turns at the next claim, not left behind."""
    s, _, _, stubs = stack
    queue = s.server.ingest.injection.queue
    ids = submit(stubs["alice"], 2, 0, "old")
    queue.client.delete(queue.turns, f"{queue.base}:inject:q:alice")  # the layout before this version
    reply = stubs["ingest"].ClaimPrompts(rollout_pb2.ClaimRequest(sampler_id="sampler-0", max_prompts=8))
    assert sorted(p.prompt_id for p in reply.prompts) == sorted(ids)


def test_a_sampler_in_debt_repays_it_however_long_it_was_quiet(shared_redis, run_name):
    """A sampler that took a prompt wider than its credit is in debt, which its next claims repay. Another sampler's
    claim a minute later deleted the quiet sampler's credit, debt included, so one that waited over a minute for the
    rows of each wide prompt took the next one at once: every batch injected, past prompts.max_injected_fraction."""
    from grpo_stream.common.rollouts.redis_server import connect
    from grpo_stream.trainer_service.ingest.prompt_queue import ACTIVE_SAMPLER_S, InjectedShare, PromptQueue
    from tests.support import FakeClock

    clock = FakeClock()
    queue = PromptQueue(connect(shared_redis.url, 5), run_name, clock=clock)
    items = []
    for _ in range(3):
        pid = queue.new_id()
        items.append((pid, 0, rollout_pb2.InjectedPrompt(prompt_id=pid, num_generations=64).SerializeToString(), b"",
                      False, [], 64))
    queue.submit("alice", items, 100, 100, 9)
    share = InjectedShare(0.5, 16, 4)  # half of 16 groups of 4 rows: 32 rows of credit a batch
    taken = []
    for _ in range(2):
        taken.append(len(queue.claim("s0", 4, 3600, share, batch_groups=16)))
        clock.advance(ACTIVE_SAMPLER_S + 1)  # s0 waits for its 64 rows to free
        queue.claim("s1", 0, 3600, share, batch_groups=0)  # another sampler claims meanwhile
    assert taken == [1, 0]  # 64 rows on 32 of credit: the second batch repays the debt instead of taking more


def test_a_finished_prompt_leaves_its_tags_set_even_when_its_hash_expired_first(shared_redis, run_name):
    """A finished prompt's hash expires at the end of its retention, often before a later finish evicts it, which
    then found no tags and left its id in their sets: a tag in constant use grew without bound."""
    import time

    from grpo_stream.common.rollouts.redis_server import connect
    from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue

    queue = PromptQueue(connect(shared_redis.url, 5), run_name)
    first, second = queue.new_id(), queue.new_id()
    queue.submit("alice", [(pid, 0, rollout_pb2.InjectedPrompt(prompt_id=pid).SerializeToString(), b"", False,
                            ["probe"], 4) for pid in (first, second)], 10, 10, 9, retention_s=60)
    queue.cancel("alice", False, [first], retention_s=1)
    time.sleep(1.5)  # Redis's own clock: the first one's hash is gone
    assert queue.records([first]) == [None]
    queue.cancel("alice", False, [second], retention_s=1)  # a later finish evicts what finished over 1 s ago
    assert queue.tagged("probe") == [second]
    assert queue.client.ttl(f"{queue.base}:tag:probe") >= 1  # and the set lives the retention of its newest
