"""A verifiers rollout's per-turn token records -> one episode: the model's ids with their logprobs and the versions
the endpoint recorded for them, the ids the environment's messages added between turns as observation tokens (not
trained on), truncation at the episode budget, and refusal of what cannot be one token sequence (logic only: the real
package and endpoint run in tests/e2e/test_verifiers_run.py)."""

import asyncio

import numpy as np
import pytest

from grpo_stream.common.endpoint.generation import RolloutVersions
from grpo_stream.common.episodes.verifiers import RolloutError, group_results, result_of


def turn(prompt, completion, logprobs=None):
    return {"tokens": {"prompt_ids": prompt, "completion_ids": completion,
                       "completion_logprobs": logprobs or [-0.5] * len(completion)}}


def versions_of(out, version=3):
    log = RolloutVersions()
    log.open("g")
    for step in out.get("trajectory") or []:
        if step.get("tokens"):
            ids = step["tokens"]["completion_ids"]
            log.record("g", step["tokens"]["prompt_ids"], ids, [version + i % 2 for i in range(len(ids))])
    return log.take("g")


def test_turns_become_model_tokens_with_observations_between_them():
    out = {"trajectory": [turn([1, 2, 3], [10, 11], [-0.1, -0.2]),
                          turn([1, 2, 3, 10, 11, 50, 51], [12], [-0.3])],
           "reward": 1.25, "metrics": {"correct_answer": 1.0, "brevity": 1.0, "label": "x"}}
    r = result_of(out, versions_of(out), max_tokens=64)
    assert r.prompt_ids == [1, 2, 3]
    assert r.tokens == [10, 11, 50, 51, 12]
    assert r.model_mask == [True, True, False, False, True]
    assert np.allclose(r.logprobs, [-0.1, -0.2, 0.0, 0.0, -0.3])
    assert r.versions == [3, 4, 4, 4, 3]  # an observation takes the version of the turn it answers
    assert r.reward == 1.25 and r.reward_components == {"correct_answer": 1.0, "brevity": 1.0}
    assert r.finished


def test_an_episode_over_the_budget_is_cut_and_marked_truncated():
    out = {"trajectory": [turn([1], [5, 6, 7, 8])], "reward": 0.0, "is_truncated": False}
    r = result_of(out, versions_of(out), max_tokens=3)
    assert r.tokens == [5, 6, 7] and len(r.versions) == 3 and not r.finished


@pytest.mark.parametrize("out, why", [
    ({"trajectory": [turn([1, 2], [3]), turn([1, 9, 3, 4], [5])]}, "does not continue"),
    ({"trajectory": [{"tokens": None}]}, "no token ids"),
    ({"trajectory": []}, "no model call"),
    ({"trajectory": [turn([1], [2])], "error": "ModelError: refused"}, "ModelError"),
])
def test_what_is_not_one_token_sequence_is_refused(out, why):
    with pytest.raises(RolloutError, match=why):
        result_of(out, versions_of(out), max_tokens=64)


def test_an_answer_the_endpoint_kept_no_versions_for_is_refused():
    out = {"trajectory": [turn([1], [2, 3])], "reward": 1.0}
    with pytest.raises(RolloutError, match="recorded no versions"):
        result_of(out, {}, max_tokens=64)


@pytest.mark.parametrize("overrides, message", [
    (["task.name=verifiers"], "task.verifiers.environment"),
    (["task.name=verifiers", "task.verifiers.environment=x", "environment.name=arith_tools"], "environment.name"),
])
def test_a_verifiers_run_is_configured_completely(overrides, message):
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.config.schema import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def results_of(run_group, rows=2, timeout_s=5.0):
    """group_results over `run_group`, with the versions record taken counted."""
    taken = []
    out = {"trajectory": [turn([1], [2, 3])], "reward": 1.0}

    def take():
        taken.append(True)
        return versions_of(out)
    results = asyncio.run(group_results(run_group, rows, take, 64, timeout_s))
    assert taken == [True]  # the endpoint's record is closed whatever happened
    return results


async def hangs():
    await asyncio.Event().wait()


async def returns(outputs):
    return outputs


@pytest.mark.parametrize("run_group, why", [
    (lambda: returns([{"trajectory": [turn([1], [2, 3])], "reward": 1.0}]), "returned 1 outputs for 2 rows"),
    (lambda: returns(None), "returned NoneType outputs"),
    (lambda: returns([{"trajectory": [{"tokens": {"prompt_ids": [1], "completion_ids": [2, 3],
                                                  "completion_logprobs": None}}]}] * 2), "not an episode"),
    (lambda: returns(["not a dict"] * 2), "not an episode"),
    (lambda: hangs(), "ran past task.verifiers.group_timeout_s=0.2s"),
    (lambda: returns(1 / 0), "run_group raised ZeroDivisionError"),
], ids=["fewer", "none", "logprobs-none", "not-a-dict", "hangs", "raises"])
def test_an_environment_that_fails_hangs_or_returns_what_is_no_episode_fails_every_row_of_its_group(run_group, why):
    """Every row gets a result, so the group ends and its rows go back to the stream: before, a malformed output
    escaped the coroutine (nobody read its future) and a hang never ended, each holding its rows for ever."""
    results = results_of(run_group, rows=2, timeout_s=0.2)
    assert len(results) == 2 and all(why in (r.failed or "") for r in results), [r.failed for r in results]


def test_a_well_formed_group_is_scored_row_by_row():
    out = {"trajectory": [turn([1], [2, 3])], "reward": 1.0}
    results = results_of(lambda: returns([out, {**out, "reward": 0.5}]))
    assert [(r.failed, r.reward, r.tokens) for r in results] == [(None, 1.0, [2, 3]), (None, 0.5, [2, 3])]


def test_two_rows_answered_the_same_ids_under_different_versions_keep_the_older_version_of_each_token():
    """Rows of a group whose prompt and completion ids are equal share one record: the later answer must not make
    the group look fresher than its oldest token."""
    log = RolloutVersions()
    log.open("g")
    log.record("g", [1], [2, 3], [5, 6])
    log.record("g", [1], [2, 3], [4, 7])
    assert list(log.take("g").values()) == [[4, 6]]


@pytest.mark.parametrize("scores, named", [
    ({"reward": float("nan")}, "reward=nan"),
    ({"reward": 1.0, "metrics": {"len_ratio": float("inf")}}, "metrics['len_ratio']=inf"),
], ids=["nan-reward", "inf-metric"])
def test_a_rubrics_non_finite_score_fails_its_episode(scores, named):
    """The trainer's validate_group refused the whole group for a NaN reward, and its data position was lost: the
    episode fails here instead, so the sampler's failed-group path leaves the group out and says why."""
    out = {"trajectory": [turn([1], [2, 3])], **scores}
    results = results_of(lambda: returns([out, {"trajectory": [turn([1], [2, 3])], "reward": 0.5}]))
    assert "rubric returned a non-finite reward" in (results[0].failed or "") and named in results[0].failed
    assert results[1].failed is None and results[1].reward == 0.5


def test_a_run_group_that_ends_cancelled_by_another_task_fails_every_row():
    """run_group awaited what another task cancelled (a resource shared with a timed-out group): exception() raised
    CancelledError out of group_results, and no row of the group ever ended."""
    async def cancelled_by_another():
        shared = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, shared.cancel)
        return await shared
    results = results_of(cancelled_by_another, rows=2, timeout_s=5.0)
    assert [("cancelled" in (r.failed or "")) for r in results] == [True, True], [r.failed for r in results]


def test_every_row_of_a_group_ends_even_when_its_rollouts_task_is_cancelled():
    """VerifiersRollouts._group reports every row whatever ends it (here: its own task cancelled, as at a sampler's
    stop), so the group is never in flight for ever."""
    from grpo_stream.common.episodes.result import GroupWork
    from grpo_stream.common.episodes.stream import GroupRun
    from grpo_stream.common.episodes.verifiers import VerifiersRollouts

    ended = []
    rollouts = VerifiersRollouts.__new__(VerifiersRollouts)  # without the verifiers package: _group's parts only
    rollouts.env = type("Env", (), {"run_group": lambda self, *a, **k: hangs()})()
    rollouts.sampling_args, rollouts.model, rollouts._client, rollouts.max_tokens = {}, "m", None, 64
    rollouts.versions, rollouts.group_timeout_s = RolloutVersions(), 60.0
    rollouts.versions.open("g")
    work = GroupWork(type("P", (), {"row": {}})(), [1], 2, None, "g", 0, None)
    run = GroupRun(work, type("Stream", (), {"_episode_done": lambda self, r: ended.append(r)})(), 0)

    async def main():
        task = asyncio.ensure_future(rollouts._group(run))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    assert [bool(r and r.failed) for r in run.results] == [True, True] and ended[-1] is run  # the group ended
    assert "CancelledError" in run.results[0].failed
    assert "g" not in rollouts.versions._by_group  # the endpoint's record of the group's versions is closed too


def test_a_group_whose_rollouts_began_from_different_prompts_fails_every_row():
    """An environment that varies its prompt between rollouts of one row (a random system prompt) gave scored rows
    with two first prompts: the group builder refused the group with a ValueError, which stopped the sampler."""
    outs = [{"trajectory": [turn([1, 2], [5])], "reward": 1.0}, {"trajectory": [turn([1, 3], [5])], "reward": 0.0}]
    log = RolloutVersions()
    log.open("g")
    for out in outs:
        log.record("g", out["trajectory"][0]["tokens"]["prompt_ids"], [5], [0])
    results = asyncio.run(group_results(lambda: returns(outs), 2, lambda: log.take("g"), 64, 5.0))
    assert all("2 different first prompts" in (r.failed or "") for r in results), [r.failed for r in results]


class Words:
    """A tokenizer whose ids are words (id 0: the stop token)."""

    eos_ids = [0]
    words = {0: "<|im_end|>", 1: "<answer>41</answer>", 2: "checking", 3: "<answer>42</answer>"}

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def test_the_evaluations_answer_is_a_multi_turn_rollouts_final_turn():
    """A verifiers episode kept no turn texts, so the evaluation's accuracy, pass@k and maj@k read the model's turns
    joined, where an earlier turn's guess (the first stated answer wins) outranked its final answer."""
    from grpo_stream.common.episodes.groups import answer_text
    from grpo_stream.common.tasks.rewards import answer_correct

    out = {"trajectory": [turn([7], [1, 0]), turn([7, 1, 0, 8, 9], [2, 3, 0])], "reward": 1.0}
    decode = Words().decode
    r = result_of(out, versions_of(out), max_tokens=64, decode=lambda ids: decode([t for t in ids if t]))
    assert r.turn_texts == ["<answer>41</answer>", "checking <answer>42</answer>"]
    assert answer_correct(answer_text(r, Words()), "42") == 1.0
    # cut inside its second turn: the text of what was kept
    cut = result_of(out, versions_of(out), max_tokens=5, decode=lambda ids: decode([t for t in ids if t]))
    assert cut.turn_texts == ["<answer>41</answer>", "checking"] and not cut.finished
    # cut before it: the first turn is all there is
    first = result_of(out, versions_of(out), max_tokens=2, decode=decode)
    assert first.turn_texts == ["<answer>41</answer> <|im_end|>"]


def test_the_verifiers_kind_decodes_turns_without_their_stop_tokens():
    pytest.importorskip("verifiers")
    from types import SimpleNamespace

    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.episodes.verifiers import build

    cfg = load_config(None, ["task.name=verifiers", "task.verifiers.environment=vf-x"])
    routes = SimpleNamespace(app=None, token="t", model_name="m", versions=RolloutVersions())
    rollouts = build(cfg, SimpleNamespace(env=None), Words(), routes)
    try:
        assert rollouts._decode([2, 3, 0]) == "checking <answer>42</answer>"
    finally:
        rollouts.close()
    assert rollouts._loop.is_closed()  # its selector's descriptors released at close, not at collection


@pytest.mark.parametrize("trajectory", [
    [turn([1], [])],                           # a stop string at the start of its only answer: no token kept
    [turn([1, 2], []), turn([1, 2, 7, 8], [5])],  # ... of its first answer: the completion starts with an observation
], ids=["no-model-token", "starts-with-an-observation"])
def test_an_episode_the_ingest_would_refuse_fails_its_group_here(trajectory):
    """An answer cut at a stop string (task.verifiers.sampling_args `stop`) where it starts keeps no token: such an
    episode was sent, and the ingest refused the whole group (a completion of no token, or one whose first token is an
    observation) after the sampler had counted it as sent (a synchronous run then waited for a group that never
    came). It fails here, so the sampler leaves its group out and says why."""
    from grpo_stream.common.episodes.groups import build_group
    from grpo_stream.common.episodes.result import GroupWork
    from grpo_stream.common.rollouts.wire import GroupLimits, to_proto, validate_group

    good = {"trajectory": [turn(trajectory[0]["tokens"]["prompt_ids"], [5])], "reward": 1.0}
    outs = [{"trajectory": trajectory, "reward": 0.0}, good]
    log = RolloutVersions()
    log.open("g")
    for out in outs:
        for step in out["trajectory"]:
            log.record("g", step["tokens"]["prompt_ids"], step["tokens"]["completion_ids"],
                       [0] * len(step["tokens"]["completion_ids"]))
    results = asyncio.run(group_results(lambda: returns(outs), 2, lambda: log.take("g"), 64, 5.0))
    if results[0].failed is None:  # what the ingest would have said of the group
        problem = type("P", (), {"prompt_id": "p", "answer": "1"})()
        work = GroupWork(problem, [1], 2, None, "g", 0, None)
        group = to_proto(build_group(work, results, "s", None))
        limits = GroupLimits(max_prompt_tokens=8, max_new_tokens=64, vocab_size=16, num_generations=2)
        pytest.fail(f"sent, and refused by the ingest: {validate_group(group, limits)}")
    assert "no token the model sampled starts the completion" in results[0].failed
    assert results[1].failed is None
