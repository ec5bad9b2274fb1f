"""Which groups a sampler starts as room frees: claimed injected prompts first, in order, each with its own size and
rewards; one that does not fit the rows left waits for rows to free; dataset prompts fill the rest in stream order,
named and keyed by their data position (the same key whatever else is in flight); over-long prompts are skipped, and
a stream of nothing but over-long prompts is a config error that names the field; an unreachable ingest only means
dataset prompts; the ingest is asked for injected prompts at most every CLAIM_EVERY_S."""

import itertools
import types

import grpc
import jax
import numpy as np
import pytest

from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.protos import rollout_pb2
from grpo_stream.sampler_service import group_source
from grpo_stream.sampler_service.group_source import GroupSource


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
    vocab_size = 100

    def encode(self, text):
        return [len(word) for word in text.split()]


def prompt(pid, n, rewards=()):
    return rollout_pb2.InjectedPrompt(prompt_id=pid, prompt_token_ids=[1, 2, 3], reference_answer="5",
                                      rewards=list(rewards), num_generations=n, train=False)


def stream(texts):
    problems = (types.SimpleNamespace(prompt_id=f"p{i}", prompt=t, answer="1") for i, t in enumerate(texts))
    return zip(itertools.count(100), problems)


def builder(cfg, texts=(), claims=(), fail=False, monkeypatch=None):
    b = GroupSource(cfg, "sampler-0", WordTokenizer(), stream(itertools.cycle(texts) if texts else iter(())),
                    RewardSet(cfg.task.rewards), jax.random.key(7))
    b.ingest_stub = FakeIngest(claims, fail)
    if monkeypatch is not None:  # every call may claim (the tests do not wait out CLAIM_EVERY_S)
        monkeypatch.setattr(group_source, "CLAIM_EVERY_S", 0.0)
    return b


def test_injected_prompts_fill_rows_in_order_and_the_rest_waits(small_cfg, monkeypatch):
    b = builder(small_cfg, claims=[[prompt("a", 4), prompt("b", 2, ["answer_format"]), prompt("c", 16)]],
                monkeypatch=monkeypatch)
    works = b.injected_groups(free_rows=12, groups=4, version=3)
    assert [(w.problem.prompt_id, w.rows, w.position, w.injected) for w in works] == [("a", 4, None, True),
                                                                                      ("b", 2, None, True)]
    assert works[0].group_id == f"{small_cfg.run.name}/inj/a" and not works[0].train
    assert works[0].rewards is b.default and set(works[1].rewards.weights) == {"answer_correct", "answer_format"}
    assert [p.prompt_id for p in b.pending] == ["c"]  # 16 rows do not fit the 6 left
    assert b.ingest_stub.asked == [(4, 3)]
    works = b.injected_groups(free_rows=32, groups=4, version=3)
    assert [w.problem.prompt_id for w in works] == ["c"] and b.injected_done == 3


def test_dataset_prompts_fill_the_rows_injected_ones_leave_in_stream_order(small_cfg, monkeypatch):
    g = small_cfg.generation.num_generations
    b = builder(small_cfg, texts=["one two", "three four five"], claims=[[prompt("a", g)]], monkeypatch=monkeypatch)
    works = b.next_groups(groups=3, rows=3 * g, version=0)
    assert [w.position for w in works] == [None, 100, 101]
    assert [w.group_id for w in works[1:]] == [f"{small_cfg.run.name}/sampler-0/100",
                                               f"{small_cfg.run.name}/sampler-0/101"]
    assert works[2].prompt_ids == [5, 4, 4] and all(w.rows == g for w in works)
    assert [w.position for w in b.next_groups(groups=2, rows=10 * g, version=0)] == [102, 103]  # the stream goes on
    assert [w.position for w in b.next_groups(groups=5, rows=g, version=0)] == [104]  # rows bound the groups too


def test_a_groups_key_is_its_data_positions_whatever_else_is_in_flight(small_cfg):
    g = small_cfg.generation.num_generations
    a = builder(small_cfg, texts=["a b"], fail=True).next_groups(groups=4, rows=4 * g, version=0)
    b = builder(small_cfg, texts=["a b"], fail=True)
    later = [w for _ in range(4) for w in b.next_groups(groups=1, rows=g, version=0)]
    assert [w.position for w in a] == [w.position for w in later]
    for x, y in zip(a, later):
        assert np.array_equal(jax.random.key_data(x.key), jax.random.key_data(y.key))
    assert len({tuple(np.asarray(jax.random.key_data(w.key)).tolist()) for w in a}) == 4


def test_the_ingest_is_asked_for_injected_prompts_at_most_every_claim_interval(small_cfg):
    b = builder(small_cfg, texts=["a b"])
    for _ in range(5):
        b.next_groups(groups=1, rows=small_cfg.generation.num_generations, version=0)
    assert len(b.ingest_stub.asked) == 1


def test_over_long_prompts_are_skipped_and_a_stream_of_only_those_is_a_config_error(small_cfg, monkeypatch):
    limit = small_cfg.generation.max_prompt_tokens
    g = small_cfg.generation.num_generations
    b = builder(small_cfg, texts=["x " * (limit + 1), "short one"], fail=True)
    assert [w.position for w in b.next_groups(groups=2, rows=2 * g, version=0)] == [101, 103]
    monkeypatch.setattr(group_source, "MAX_SKIPPED_PROMPTS", 5)
    with pytest.raises(ValueError, match="generation.max_prompt_tokens"):
        builder(small_cfg, texts=["x " * (limit + 1)], fail=True).next_groups(groups=1, rows=g, version=0)


def test_a_stream_of_only_over_long_prompts_stops_the_sampler_for_good(small_cfg, monkeypatch):
    """A restarted sampler resumes at the same data positions and meets the same prompts: restarting cannot help, so
    the error is permanent (`up` records it and restarts nothing), not one `up` restarts until its budget runs out."""
    monkeypatch.setattr(group_source, "MAX_SKIPPED_PROMPTS", 5)
    limit, g = small_cfg.generation.max_prompt_tokens, small_cfg.generation.num_generations
    with pytest.raises(PermanentError, match="generation.max_prompt_tokens"):
        builder(small_cfg, texts=["x " * (limit + 1)], fail=True).next_groups(groups=1, rows=g, version=0)


def test_an_unreachable_ingest_leaves_the_rows_to_dataset_prompts(small_cfg, monkeypatch):
    g = small_cfg.generation.num_generations
    b = builder(small_cfg, texts=["a b"], fail=True, monkeypatch=monkeypatch)
    assert b.injected_groups(free_rows=32, groups=4, version=0) == []
    assert [w.position for w in b.next_groups(groups=2, rows=2 * g, version=0)] == [100, 101]


def test_no_dataset_group_takes_the_rows_an_injected_prompt_waits_for(small_cfg, monkeypatch):
    g = small_cfg.generation.num_generations
    b = builder(small_cfg, texts=["one two"], claims=[[prompt("wide", 3 * g)]], monkeypatch=monkeypatch)
    assert b.next_groups(groups=2, rows=2 * g, version=0) == []  # 3 groups' rows do not fit 2: none start
    assert b.injected_rows_waiting() == 3 * g
    works = b.next_groups(groups=3, rows=3 * g, version=0)
    assert [(w.problem.prompt_id, w.rows) for w in works] == [("wide", 3 * g)] and b.injected_rows_waiting() == 0


def test_an_injected_prompt_wider_than_a_sampler_can_start_is_skipped_not_waited_for(small_cfg, monkeypatch):
    """A prompt the ingest accepted under another config: waiting for rows that can never free would stop every
    prompt after it (and every dataset prompt)."""
    most = small_cfg.largest_group()
    b = builder(small_cfg, texts=["one two"], claims=[[prompt("too-wide", most + 1), prompt("a", 2)]],
                monkeypatch=monkeypatch)
    works = b.next_groups(groups=2, rows=most, version=0)  # the most room a sampler ever has
    assert [w.problem.prompt_id for w in works] == ["a", "p0"] and b.injected_refused == 1
    b.pending.append(prompt("too-wide-again", most + 1))
    assert b.injected_rows_waiting() == 0 and b.injected_refused == 2  # the feeder keeps no rows for it


def test_an_injected_prompt_wider_than_a_group_starts_while_the_feeder_runs_the_stream(small_cfg, monkeypatch):
    """The feeder's own _feed over a real RolloutStream whose episodes end one at a time, as multi-turn episodes do:
    a train=false prompt of three groups' rows once waited behind dataset groups (they took each freed row) and held
    every injected prompt after it for thousands of episodes. It now starts once its rows free, the next at once."""
    from grpo_stream.common.episodes.single_turn import SingleTurn
    from grpo_stream.common.episodes.stream import RolloutStream
    from grpo_stream.sampler_service.loop import Sampler

    g, rows = small_cfg.generation.num_generations, 8 * small_cfg.generation.num_generations
    b = builder(small_cfg, texts=["one two"], claims=[[]] * 5 + [[prompt("wide", 3 * g), prompt("small", 1)]],
                monkeypatch=monkeypatch)
    started = []
    stream = RolloutStream(lambda rng, n: [None] * n, lambda run: None)
    start = stream.start
    stream.start = lambda work, kind, version=0: (started.append(work.problem.prompt_id), start(work, kind, version))
    feeder = types.SimpleNamespace(
        cfg=small_cfg, stream=stream, rows_in_flight=rows, slots=rows, source=b, groups_started=0,
        _held_back=lambda: False, _version_allows=lambda: 2**31 - 1, client=types.SimpleNamespace(unacked=0),
        sink=types.SimpleNamespace(pending=lambda: 0),
        weights=types.SimpleNamespace(version=0, epoch="", group_started=lambda: None),
        admission=types.SimpleNamespace(admit=lambda wanted, version, holding: wanted),
        rollouts=SingleTurn(8), injected_rollouts=SingleTurn(8))
    engine, ends = [], 0
    while "small" not in started and ends < 10 * rows:
        Sampler._feed(feeder, feeder)  # the feeder stands for its parts too (parts.client)
        engine += stream.take()
        stream.finish(engine.pop(0), [5], [0.0], None, True)  # one episode ends, the oldest first
        ends += 1
    claimed = started.index("wide")
    assert started[claimed + 1] == "small" and ends <= 5 + 2 * rows, (ends, started[-5:])


@pytest.mark.parametrize("rows, ids, why", [
    (0, [1, 2, 3], "num_generations 0: a group needs at least 1 row"),
    (2, [], "prompt_token_ids: 0 tokens"),
    (2, "too long", "generation.max_prompt_tokens"),
    (2, [5, 10**6], "prompt_token_ids: ids outside 0.."),  # the embedding lookup clamps: no error, another token
])
def test_an_injected_prompt_this_sampler_cannot_start_is_refused_once_logged_and_the_next_starts(
        small_cfg, monkeypatch, caplog, rows, ids, why):
    """Redis can be written by others, and the ingest's config can differ: a group of no rows never ends (held for
    the sampler's life), an empty or over-long prompt raised on the engine's thread and stopped the sampler, and the
    claim's lease handed it out again to the next sampler (a crash loop)."""
    longest = small_cfg.generation.max_prompt_tokens
    ids = [5] * (longest + 1) if ids == "too long" else ids
    bad = rollout_pb2.InjectedPrompt(prompt_id="bad", prompt_token_ids=ids, reference_answer="1",
                                     num_generations=rows, train=True)
    fitting = rollout_pb2.InjectedPrompt(prompt_id="fits", prompt_token_ids=[5] * longest, reference_answer="1",
                                         num_generations=2, train=True)
    b = builder(small_cfg, claims=[[bad, fitting], [bad]], monkeypatch=monkeypatch)
    works = b.injected_groups(free_rows=8, groups=4, version=0)
    assert [w.problem.prompt_id for w in works] == ["fits"] and b.injected_refused == 1
    assert b.injected_groups(free_rows=8, groups=4, version=0) == [] and b.injected_refused == 2  # claimed again
    refusals = [r.getMessage() for r in caplog.records if "'bad' not generated" in r.getMessage()]
    assert len(refusals) == 1 and why in refusals[0]  # counted each time, said once


def test_a_resumed_stream_gives_its_unanswered_positions_first_with_their_own_problems(small_cfg):
    """A restarted sampler resumed after its highest accepted position: prompts whose groups were in flight or unsent
    below it were skipped for good. It now generates those first, each at its own position (its group id and
    sampling key) with the problem an uninterrupted stream has there, then goes on from the start."""
    from grpo_stream.common.assembly.parts import build_task_and_tokenizer  # noqa: PLC0415
    from grpo_stream.sampler_service.group_source import resumed_prompts  # noqa: PLC0415

    task, _ = build_task_and_tokenizer(small_cfg)
    whole = list(itertools.islice(zip(itertools.count(), task.train_stream(1, 2, 0)), 40))
    resumed = list(itertools.islice(resumed_prompts(task, 1, 2, 30, (12, 27, 29)), 6))
    assert [p for p, _ in resumed] == [12, 27, 29, 30, 31, 32]
    assert [problem for _, problem in resumed] == [whole[p][1] for p in (12, 27, 29, 30, 31, 32)]
    assert [p for p, _ in itertools.islice(resumed_prompts(task, 1, 2, 5), 3)] == [5, 6, 7]  # nothing unanswered


class AlternatingLengthTask:
    """A data stream whose even positions below 21 are over generation.max_prompt_tokens and every other one fits."""

    def __init__(self, too_long: int):
        self.too_long = too_long

    def train_stream(self, index, count, start):
        for position in itertools.count(start):
            long = position % 2 == 0 and position < 21
            yield types.SimpleNamespace(prompt_id=f"p{position}", answer="1",
                                        prompt="x " * self.too_long if long else "short one")


def test_a_resumed_stream_whose_unanswered_positions_are_over_long_prompts_goes_on_to_the_rest(small_cfg,
                                                                                             monkeypatch):
    """The over-long prompts a sampler skipped stay unanswered, and a restarted one is handed them first, one after
    another (the answered positions between them are not): never more than one in a row in the stream, they were
    counted as a stream of nothing but over-long prompts, and every restart failed (a dataset with a quarter of its
    prompts over the limit: over MAX_SKIPPED_PROMPTS of them in the 4,096 positions a resume looks back over)."""
    from grpo_stream.sampler_service.group_source import resumed_prompts  # noqa: PLC0415

    monkeypatch.setattr(group_source, "MAX_SKIPPED_PROMPTS", 5)
    g = small_cfg.generation.num_generations
    task = AlternatingLengthTask(small_cfg.generation.max_prompt_tokens + 1)
    skipped = tuple(range(0, 21, 2))  # the first run skipped these 11 and answered the others up to 21
    b = GroupSource(small_cfg, "sampler-0", WordTokenizer(), resumed_prompts(task, 0, 1, 22, skipped),
                    RewardSet(small_cfg.task.rewards), jax.random.key(7))
    assert [w.position for w in b.next_groups(groups=2, rows=2 * g, version=0)] == [22, 23]
