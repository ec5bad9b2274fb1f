"""Weight versions under churn and faults (issue 6), with real sampler and trainer processes.

1. No group mixes versions (sampler.weight_updates=drain): this test serves weights (a real TrainerServer on
   loopback, ingest into a real Redis) and publishes a new, clearly different version every 0.3 s while a
   `grpo-stream sampler` process generates (faster than it installs them: each installed version must still
   start its groups; tests/unit/sampler_service/test_drain_turns.py has the rule). Every group's behaviour
   logprobs are recomputed under the version the group says it used: they agree to float32 noise, and disagree
   under the neighbouring versions. A group that switched weights part-way would match neither.
2. Killing the trainer (kill -9) in the middle of a slow weight transfer: the samplers keep their installed
   version, start no new group while the ingest cannot admit one, count fetch failures, and install the
   restarted trainer's versions; the restarted run completes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.common.rollouts.redis_server import connect, free_port
from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.rollouts.wire import GroupLimits, decode_group
from tests.e2e.test_up import ROOT
from tests.support import deployment_auth, wait_for
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.learning.batching import layout
from grpo_stream.trainer_service.server import TrainerServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]
CONFIG = ROOT / "configs" / "tiny_arith_smoke.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def cli(*args, log, auth: dict[str, str]):
    return subprocess.Popen([sys.executable, "-m", "grpo_stream", *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**ENV, **auth})


def recomputer(model, cfg, pad_id):
    """recompute(params, group): max |recomputed - recorded| behaviour logprob per completion of `group` under
    `params`. Every group is in the trainer's layout (batching.layout: the config's longest prompt and completion),
    and the forward pass is one compiled program: eagerly, each new width compiled every operation again (about a
    third of the test's time)."""
    gen = cfg.generation
    P = gen.max_prompt_tokens
    forward = jax.jit(lambda params, tokens, valid: sequence_logprobs(model, params, tokens, valid, gen.temperature,
                                                                      pad_id))

    def recompute(params, group) -> np.ndarray:
        rows = [layout(np.asarray(group.prompt_token_ids), np.asarray(c.token_ids), P, gen.max_new_tokens, pad_id)
                for c in group.completions]
        tokens, valid = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        logp = np.asarray(forward(params, jnp.asarray(tokens), jnp.asarray(valid)))
        return np.array([np.abs(logp[i, P - 1:P - 1 + len(c.token_ids)] - c.logprobs).max()
                         for i, c in enumerate(group.completions)])

    return recompute


def test_no_group_mixes_weight_versions(tmp_path, shared_redis, run_name):
    overrides = ["sampler.replicas=1", "sampler.weight_poll_s=0.05", "trainer.max_staleness=1000",
                 "sampler.rows_in_flight=8", "sampler.weight_updates=drain", "sampler.backlog_max_groups=256",
                 "sampler.metrics_port=null", f"run.name={run_name}"]  # the buffer's: the ingest refuses another
    cfg = load_config(CONFIG, overrides)
    task, tokenizer = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tokenizer.vocab_size, seed=0)
    base = model.to_named_numpy()

    def weights(v: int) -> dict[str, np.ndarray]:
        # each version its own perturbation of one size: neighbours differ as clearly at version 500 as at 5, and
        # the weights do not grow with the count of versions a slow sampler lets pass (with base + v * noise a
        # loaded machine reached versions whose logits broke the float32 agreement bound)
        rng = np.random.default_rng(1000 + v)
        return {n: a + rng.standard_normal(a.shape).astype(np.float32) * 0.05 for n, a in base.items()}

    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    gen = cfg.generation
    limits = GroupLimits(gen.num_generations, gen.max_prompt_tokens, gen.max_new_tokens, tokenizer.vocab_size)
    publisher = WeightPublisher()
    auth, security = deployment_auth(tmp_path / "auth")
    server = TrainerServer(IngestServicer(buffer, limits, 100_000, 20), publisher, "127.0.0.1", 0, security=security)
    port = server.start()
    publisher.publish_arrays(0, weights(0))
    log = open(tmp_path / "sampler.log", "w")
    proc = cli("sampler", "--config", str(CONFIG), "--index", "0", *overrides, f"trainer.port={port}", log=log,
               auth=auth)
    groups, version = [], 0
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.3)  # the churn under test (a new version every 0.3 s), not a wait for a state
            arrived = [decode_group(e.payload) for e in buffer.read(1000, 0)]
            groups += arrived
            if len(groups) >= 24 and len({g.policy_version for g in groups}) >= 4:
                break
            # a new version every tick, faster than a loaded sampler installs one (about 0.5 s): each installed
            # version still starts its groups before the next drain (before, the sampler installed 79 versions in
            # 57 s and generated 2 groups)
            version += 1
            buffer.log_step("churn", version, [])  # as a trainer does: the ingest takes only versions it logged
            publisher.publish_arrays(version, weights(version))
        buffer.log_step("churn", version + 1, [])
        publisher.publish_arrays(version + 1, weights(version + 1), final=True)
        assert proc.wait(timeout=120) == 0, (tmp_path / "sampler.log").read_text()[-3000:]
        groups += [decode_group(e.payload) for e in buffer.read(1000, 0)]
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop(0)
        log.close()
    used = sorted({g.policy_version for g in groups})
    assert len(groups) >= 24 and len(used) >= 4, (len(groups), used)
    params = {}

    def at(v):
        if v not in params:
            params[v] = model.params_from_arrays({n: jnp.asarray(a) for n, a in weights(v).items()})
        return params[v]

    own, neighbours, recomputed = [], [], recomputer(model, cfg, tokenizer.pad_id)
    for g in groups:
        own.append(recomputed(at(g.policy_version), g).max())
        neighbours.append(min(recomputed(at(v), g).min()
                              for v in (g.policy_version - 1, g.policy_version + 1) if v >= 0))
    print(f"{len(groups)} groups over versions {used[0]}..{used[-1]}: own max {max(own):.2e}, "
          f"neighbours min {min(neighbours):.2e}")
    # every completion of every group came from exactly the version recorded on the group
    assert max(own) < 1e-3, f"groups disagree with their recorded version: {sorted(own)[-5:]}"
    assert min(neighbours) > 20 * max(own), (min(neighbours), max(own))
    # versions only move forward within the sampler
    by_sampler = [g.policy_version for g in sorted(groups, key=lambda g: int(g.group_id.rsplit("/", 1)[1]))]
    assert by_sampler == sorted(by_sampler)


def scrape(port: int) -> dict[str, float]:
    """The unlabelled samples of a sampler's Prometheus /metrics page without the `grpo_stream_` prefix (empty
    while the page is not up yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^grpo_stream_(\w+) ([-+\d.e]+)$", text, re.M)}


STEPS = 20


@pytest.mark.chaos  # a killed trainer mid-transfer (75 s); the transfer faults of one side stay in the default lane
def test_trainer_killed_mid_transfer_samplers_wait_then_follow_the_restart(tmp_path, shared_redis, run_name):
    """With admission control a sampler starts no new batch while the ingest cannot answer (the trainer that judges
    what is trainable is gone); it keeps its groups in hand, survives the failed weight fetch, and follows the
    restarted trainer to the end of the run."""
    port, metrics = free_port(), free_port()
    # the demo's model size, so generation runs at a realistic pace next to the trainer's steps
    model = ["model.tiny.num_layers=2", "model.tiny.embed_dim=128", "model.tiny.hidden_dim=384",
             "model.tiny.head_dim=32"]
    cfg = load_config(CONFIG, model)
    _, tokenizer = build_task_and_tokenizer(cfg)
    nbytes = build_policy(cfg, tokenizer.vocab_size, seed=0).num_params() * 4
    overrides = [*model, "logging.verbose=true", f"redis.url={shared_redis.url}", f"run.name={run_name}",
                 f"trainer.port={port}", "trainer.metrics_port=null",
                 f"sampler.metrics_port={metrics}", "sampler.weight_poll_s=0.05",
                 # room for what is generated while the trainer is away
                 "sampler.backlog_max_groups=4000", "buffer.max_groups=64", "trainer.groups_per_step=32", f"trainer.steps={STEPS}", "trainer.publish_every=2", "trainer.max_staleness=8",
                 "trainer.eval_before=false", "trainer.eval_after=false", "trainer.final_wait_s=60",
                 "weights.fetch_streams=1", "weights.retry_initial_s=0.2", "weights.retry_max_s=1.0",
                 # each transfer takes about 2.5 s, so the kill lands inside one
                 f"weights.max_serve_mb_s={nbytes / 2.5 / 1e6:.6f}"]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("trainer-1", "trainer-2", "sampler-0",
                                                                   "sampler-1")}
    text = {name: lambda name=name: (tmp_path / f"{name}.log").read_text() for name in logs}
    auth, _ = deployment_auth(tmp_path / "auth")
    procs = {"trainer-1": cli("trainer", "--config", str(CONFIG), "--run-dir", str(tmp_path / "run-1"), *overrides,
                              log=logs["trainer-1"], auth=auth)}
    for i in range(2):
        procs[f"sampler-{i}"] = cli("sampler", "--config", str(CONFIG), "--index", str(i), "--run-dir",
                                    str(tmp_path), *overrides, log=logs[f"sampler-{i}"], auth=auth)
    try:
        # both samplers generate with a first version; then a later version starts streaming to one of them
        wait_for(lambda: all(scrape(metrics + i).get("sampler_groups_total", 0) > 0 for i in range(2)), 240,
                 "both samplers to generate")
        wait_for(lambda: any(re.search(r"fetching weight version [1-9]", text[f"sampler-{i}"]()) for i in range(2)),
                 240, "a second version to be fetched")
        before = [scrape(metrics + i) for i in range(2)]
        procs["trainer-1"].send_signal(signal.SIGKILL)
        procs["trainer-1"].wait(timeout=30)

        def carried_on():
            """Both samplers are alive and waiting, and at least one counted a failed fetch."""
            for i in range(2):
                assert procs[f"sampler-{i}"].poll() is None, text[f"sampler-{i}"]()[-2000:]
            after = [scrape(metrics + i) for i in range(2)]
            if sum(a.get("sampler_weight_fetch_failures", 0) for a in after) >= 1 and \
                    "admission request failed" in text["sampler-0"]() + text["sampler-1"]():
                return after
            return None

        after = wait_for(carried_on, 120, "both samplers to wait for the ingest and count a failed fetch")
        for i in range(2):  # still on the version installed before the kill
            assert after[i]["sampler_weight_version"] == before[i]["sampler_weight_version"]
        assert "weight fetch failed" in text["sampler-0"]() + text["sampler-1"]()

        procs["trainer-2"] = cli("trainer", "--config", str(CONFIG), "--run-dir", str(tmp_path / "run-2"),
                                 *overrides, log=logs["trainer-2"], auth=auth)
        assert procs["trainer-2"].wait(timeout=600) == 0, text["trainer-2"]()[-4000:]
        for i in range(2):
            assert procs[f"sampler-{i}"].wait(timeout=120) == 0, text[f"sampler-{i}"]()[-3000:]
    except AssertionError as exc:
        tails = "\n".join(f"--- {name}.log\n{read()[-1500:]}" for name, read in text.items())
        raise AssertionError(f"{exc}\n{tails}") from None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()
    summary = json.loads((tmp_path / "run-2" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["weight_versions"][-1] == STEPS
    # the restarted trainer's versions reached both samplers, ending with its final one
    assert set(summary["sampler_weight_versions"]) == {"sampler-0", "sampler-1"}
    assert all(v[0] == 0 and v[-1] == STEPS for v in summary["sampler_weight_versions"].values())
    for i in range(2):
        installed = json.loads((tmp_path / f"sampler-{i}.json").read_text())["versions"]
        # the first trainer's versions in order, then the second's in order, ending with its final one. Where the
        # new epoch starts the numbers may drop (back to its version 0) or not (a sampler installs the newest
        # version, so it may never see the new epoch's 0 when the new trainer publishes 1 quickly): at most one drop
        drops = sum(b < a for a, b in zip(installed, installed[1:]))
        assert installed[-1] == STEPS and drops <= 1, installed
