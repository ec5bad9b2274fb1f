"""Checkpoint and resume of the real trainer against a real Redis: a run interrupted at step k (stopped, crashed,
or crashed with its newest checkpoint corrupted) and resumed ends with exactly the parameters of an uninterrupted
run fed the same groups, and the audit finds every group trained once."""

import pathlib
import tempfile
import threading

import jax
import pytest

from grpo_stream.common.episodes.finite import run_groups
from grpo_stream.common.episodes.groups import build_group
from grpo_stream.common.episodes.result import GroupWork
from grpo_stream.common.episodes.single_turn import SingleTurn
from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.common.weights.snapshot import digest
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.reports.audit import build_audit
from tests.conftest import CONFIGS
from grpo_stream.trainer_service.learning.collector import GroupCollector
from grpo_stream.trainer_service.core import TrainerCore
from grpo_stream.trainer_service.loop import Trainer

pytestmark = pytest.mark.redis
STEPS, GROUPS_PER_STEP, EVERY = 6, 4, 2


# the trainer's server authenticates as in production; nothing here calls it
TOKENS = str(write_tokens(pathlib.Path(tempfile.mkdtemp(prefix="resume-auth-")))["table"])


class SimulatedCrash(Exception):
    pass


def config(url: str, run: str, **extra):
    overrides = {"model.tiny.embed_dim": 32, "model.tiny.hidden_dim": 64, "model.tiny.head_dim": 8,
                 "generation.num_generations": 4, "redis.url": url, "run.name": run, "run.deterministic": True,
                 "trainer.steps": STEPS, "trainer.groups_per_step": GROUPS_PER_STEP, "trainer.max_staleness": 10,
                 "trainer.port": 0, "trainer.metrics_port": None, "trainer.eval_before": False,
                 "trainer.eval_after": False, "trainer.final_wait_s": 0, "warmstart.steps": 0,
                 "checkpoint.every": EVERY, "auth.tokens_file": TOKENS, **extra}
    return load_config(CONFIGS / "tiny_arith.yaml", [f"{k}={'null' if v is None else v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def groups(tiny_parts):
    """STEPS x GROUPS_PER_STEP real rollout groups from the initial policy, as the samplers would send them."""
    cfg = config("redis://unused:1/0", "x")
    from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer

    task, tokenizer = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tokenizer.vocab_size, seed=cfg.run.seed)
    gen = cfg.generation
    engine = ContinuousEngine(model, tokenizer.pad_id, tokenizer.eos_ids, gen.max_prompt_tokens, gen.max_new_tokens, 1.0)
    problems = [task.train_problem(i) for i in range(STEPS * GROUPS_PER_STEP)]
    works = [GroupWork(p, tokenizer.encode(p.prompt), gen.num_generations, RewardSet(cfg.task.rewards), f"g{i}", i,
                       jax.random.fold_in(jax.random.key(7), i)) for i, p in enumerate(problems)]
    made = run_groups(engine, model.params, works, SingleTurn(gen.max_new_tokens))
    return [to_proto(build_group(work, results, "sampler-0", tokenizer)) for work, results in zip(works, made)]


def fill(url: str, run: str, groups) -> RedisStreamBuffer:
    buffer = RedisStreamBuffer(connect(url, 5), run)
    statuses, _ = buffer.append_many([Incoming(g.group_id, g.sampler_id, g.policy_version, g.data_position,
                                               g.SerializeToString()) for g in groups], max_groups=1000)
    assert all(s not in ("dup", "full") for s in statuses)
    return buffer


def final_digest(trainer: Trainer) -> str:
    return digest(trainer.model.to_named_numpy(trainer.params))


def run_trainer(cfg, run_dir: pathlib.Path) -> Trainer:
    trainer = Trainer(cfg, run_dir)
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def uninterrupted(groups, shared_redis, new_run_name, tmp_path_factory):
    run = new_run_name()
    fill(shared_redis.url, run, groups)
    trainer = run_trainer(config(shared_redis.url, run), tmp_path_factory.mktemp("whole"))
    return final_digest(trainer)


@pytest.mark.parametrize("how", ["sigterm", "crash", "crash_and_corrupt_checkpoint", "crash_without_prefetch"])
def test_a_resumed_run_ends_with_the_parameters_of_an_uninterrupted_one(how, groups, uninterrupted, shared_redis,
                                                                        run_name, tmp_path, monkeypatch):
    """sigterm, crash: once step 6's plan was made ahead (trainer.prefetch_plans, the default) and not trained; its
    groups are trained once, by the resumed run. crash_without_prefetch: prefetch_plans=false (the uninterrupted run
    prefetches: the same parameters either way)."""
    buffer = fill(shared_redis.url, run_name, groups)
    cfg = config(shared_redis.url, run_name, **{"trainer.prefetch_plans": how != "crash_without_prefetch"})
    first = Trainer(cfg, tmp_path)
    original, collect = RedisStreamBuffer.log_step, GroupCollector.collect
    prefetched = threading.Event()

    def recorded(self, step, cancel=None):
        picked = collect(self, step, cancel)
        if step == 6 and picked is not None and threading.current_thread().name == "plan-prefetch":
            prefetched.set()
        return picked

    def interrupt(self, epoch, step, group_ids):  # recording step 5's groups, on the step-books thread
        original(self, epoch, step, group_ids)
        if step == 5 and how == "crash":  # step 6's groups read, its plan made, while step 5 computed
            assert prefetched.wait(60), "step 6's plan was not made ahead"
        if step == 5 and how != "sigterm":
            raise SimulatedCrash  # raised on the main thread at the next step's hand-off

    def stepped(self, plan):  # on the main thread: after step 5 trained (checkpoints at 2 and 4)
        result = original_step(self, plan)
        if plan.step == 5 and how == "sigterm":
            assert prefetched.wait(60), "step 6's plan was not made ahead"
            first.stop_event.set()  # what SIGTERM does
        return result

    original_step = TrainerCore.step
    monkeypatch.setattr(TrainerCore, "step", stepped)
    monkeypatch.setattr(RedisStreamBuffer, "log_step", interrupt)
    monkeypatch.setattr(GroupCollector, "collect", recorded)
    if how == "sigterm":
        summary = first.run()
        assert summary["steps"] == 5 and summary["stopped_early"] and summary["checkpoints_saved"][-1] == 5
    else:
        with pytest.raises(SimulatedCrash):
            first.run()
    monkeypatch.setattr(RedisStreamBuffer, "log_step", original)
    if how == "crash_without_prefetch":
        assert not prefetched.is_set()
    if how == "crash_and_corrupt_checkpoint":
        chunks = [p for p in (tmp_path / "checkpoints" / "4" / "state").rglob("*") if p.is_file()]
        biggest = max(chunks, key=lambda p: p.stat().st_size)
        data = bytearray(biggest.read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
        biggest.write_bytes(bytes(data))
    second = run_trainer(cfg, tmp_path)
    expected_start = {"sigterm": 5, "crash": 4, "crash_and_corrupt_checkpoint": 2, "crash_without_prefetch": 4}[how]
    assert second.resumed_from["step"] == expected_start
    assert final_digest(second) == uninterrupted
    report = build_audit(buffer.client, run_name)
    assert report["ok"] and report["groups_trained"] == STEPS * GROUPS_PER_STEP and report["groups_lost"] == 0
    assert report["groups_trained_twice"] == 0 and report["trainer_resumes"] == 1
    assert report["steps_rolled_back"] == 5 - expected_start
    assert buffer.counters()["trained"] == STEPS * GROUPS_PER_STEP and buffer.depth() == 0
    if how == "crash_and_corrupt_checkpoint":
        assert list((tmp_path / "checkpoints").glob("corrupt-4-*"))


def test_checkpoints_of_another_layout_are_refused_not_discarded(groups, shared_redis, run_name, tmp_path):
    url = shared_redis.url
    fill(url, run_name, groups[:8])
    run_trainer(config(url, run_name, **{"trainer.steps": 2}), tmp_path)
    with pytest.raises(ValueError, match="holds a different model or optimizer state"):
        run_trainer(config(url, run_name, **{"trainer.steps": 2, "algo.beta": 0.1}), tmp_path)
    with pytest.raises(ValueError, match=r"holds checkpoints \(steps \[2\]\) and checkpoint.resume=false"):
        run_trainer(config(url, run_name, **{"checkpoint.resume": False}), tmp_path)
    # a new run directory over the same run's buffer would train its groups a second time: refused
    held = rf"Redis already holds run '{run_name}' with 8 trained groups.*checkpoint.dir"
    with pytest.raises(ValueError, match=held):
        run_trainer(config(url, run_name, **{"trainer.steps": 2}), tmp_path / "elsewhere")
    assert (tmp_path / "checkpoints" / "2").is_dir()
