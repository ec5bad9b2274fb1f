"""The group sink and a reward that raises: the completion's group is left out as a failed group (logged once per
reward, with its error), never scored 0 and never the sampler's end, unless the reward fails every group: then the
sampler stops after MAX_FAILED_IN_A_ROW failed groups in a row, naming the reward."""

import logging
import threading
import time
import types

import pytest

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.episodes.stream import GroupRun
from grpo_stream.common.tasks.reward_workers import CLOSED, WorkerClosed
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.sampler_service import group_sink
from grpo_stream.sampler_service.group_sink import GroupSink
from grpo_stream.sampler_service.lifecycle import SamplerMetrics
from tests.support import wait_for


def last_int_matches(text: str, reference: str) -> float:
    """A typical user reward: the completion's last word as an integer (raises on any other completion)."""
    return float(int(text.split()[-1]) == int(reference))


class Client:
    def __init__(self):
        self.sent = 0

    def put(self, message, timeout_s, epoch="", evaluation_only=False, started_at=-1):
        self.sent += 1
        return True


def ended(texts: list[str], i: int) -> GroupRun:
    rewards = RewardSet({"user:last_int_matches": 1.0}, {"user:last_int_matches": last_int_matches})
    work = GroupWork(types.SimpleNamespace(prompt_id=f"p{i}", answer="5"), [1, 2], len(texts), rewards, f"g{i}", i,
                     None)
    run = GroupRun(work, None, 0)
    for row, text in enumerate(texts):
        run.results[row] = EpisodeResult(tokens=[7, 8], logprobs=[-0.1, -0.2], model_mask=[True, True],
                                         versions=[0, 0], turn_texts=[text], turn_closed=[True], finished=True)
    return run


def sink_of(client) -> GroupSink:
    in_process = types.SimpleNamespace(call=None, close=lambda: None)  # rewards called here, as RewardSet does
    return GroupSink(client, SamplerMetrics("s"), None, "s", 0.0, lambda: False, in_process)


def test_a_reward_that_raises_on_one_completion_fails_its_group_not_the_sampler(caplog):
    client = Client()
    sink = sink_of(client)
    with caplog.at_level(logging.WARNING, logger=group_sink.__name__):
        sink.put(ended(["so 5", "so 4"], 0))
        sink.put(ended(["so 5", "I am not sure."], 1))  # the model's own words: the reward cannot read them
        sink.put(ended(["not sure", "so 5"], 2))
        sink.put(ended(["so 5", "so 5"], 3))
        sink.close()
    sink.check()  # the sampler goes on
    assert (client.sent, sink.groups_sent, sink.groups_failed) == (2, 2, 2)
    logged = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
    assert len(logged) == 1, logged  # once per reward, with the reward's name and its error
    assert "task.rewards.user:last_int_matches raised ValueError" in logged[0] and "'sure.'" in logged[0]


def test_a_reward_broken_for_every_completion_still_stops_the_sampler(monkeypatch):
    monkeypatch.setattr(group_sink, "MAX_FAILED_IN_A_ROW", 3)
    client = Client()
    sink = sink_of(client)
    for i in range(3):
        sink.put(ended(["so 5", "no number"], i))
    sink.close()
    assert client.sent == 0
    with pytest.raises(ValueError, match=r"last 3 groups all failed.*task\.rewards\.user:last_int_matches raised"):
        sink.check()


def test_groups_whose_reward_worker_was_closed_are_left_out_not_failed(monkeypatch):
    """close() kills the reward worker under the group being scored (it waited up to task.reward_timeout_s for it
    before): that group and those still queued are left out as the stop says, never counted as failed groups (enough
    of them turned a sampler's stop into 'the last 64 groups all failed')."""
    monkeypatch.setattr(group_sink, "MAX_FAILED_IN_A_ROW", 3)

    def closed(name, fn, text, reference):
        raise WorkerClosed(CLOSED)

    client, left_out = Client(), []
    sink = GroupSink(client, SamplerMetrics("s"), None, "s", 0.0, lambda: False,
                     types.SimpleNamespace(call=closed, close=lambda: None), left_out.append)
    for i in range(4):
        sink.put(ended(["so 5", "so 5"], i))
    sink.close()
    sink.check()
    assert (client.sent, sink.groups_failed, len(left_out)) == (0, 0, 4)


class FullBacklog:
    """A rollout client whose backlog never frees (an ingest that stopped acknowledging): every put times out."""

    def __init__(self):
        self.offered = threading.Event()

    def put(self, message, timeout_s, epoch="", evaluation_only=False, started_at=-1):
        self.offered.set()
        time.sleep(0.01)
        return False


def test_a_closed_sink_stops_waiting_for_a_backlog_that_never_frees():
    """A sampler that ended on an error (no stop asked: `abandon` stays False) beside a full backlog: close() gave
    up waiting for the sink, but its thread kept offering the group to a sender that was closed next, for the life of
    the process (a sampler inside `up`'s process, a test's)."""
    client = FullBacklog()
    sink = GroupSink(client, SamplerMetrics("s"), None, "s-full", 0.0, lambda: False,
                     types.SimpleNamespace(call=lambda name, fn, text, reference: 1.0, close=lambda: None))
    sink.put(ended(["so 5", "so 5"], 0))
    assert client.offered.wait(10)
    sink.close(timeout_s=0.1)
    wait_for(lambda: "s-full-groups" not in {t.name for t in threading.enumerate()}, 10, "the sink's thread to end")
    assert sink.groups_sent == 0
