"""`grpo-stream up` as real OS processes (embedded Redis, trainer, two samplers): its errors, Ctrl-C and resume, the
waits of a sampler without its trainer; and the helpers other e2e files share. The smoke run's checks are in
test_smoke_run.py."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def run_cli(*args, timeout=600, env: dict[str, str] | None = None):
    return subprocess.run([sys.executable, "-m", "grpo_stream", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def check_run(summary: dict, replicas: int, steps: int) -> None:
    assert summary["steps"] == steps
    # every group the ingest accepted is accounted for
    assert summary["groups_ingested"] == (summary["groups_trained"] + summary["groups_dropped_stale"]
                                          + summary["groups_dropped_filtered"] + summary["groups_left_in_buffer"])
    assert summary["groups_dropped_invalid"] == 0
    assert summary["groups_trained"] >= steps  # at least one group per step
    # at least two samplers contributed groups
    assert len([s for s, n in summary["groups_by_sampler"].items() if n > 0]) >= min(2, replicas)
    # weights reached every sampler, ending with the final version
    published = summary["weight_versions"]
    assert published[0] == 0 and published[-1] == steps
    assert len(summary["sampler_weight_versions"]) == replicas
    for versions in summary["sampler_weight_versions"].values():
        assert versions == sorted(versions) and versions[-1] == steps
        assert set(versions) <= set(published)
    assert all(code == 0 for code in summary["sampler_exit_codes"].values())
    # what the samplers generated for training: every trained group, and the waste is what was not trained
    generated = sum(s["groups_generated"] for s in summary["samplers"].values())
    assert summary["groups_generated"] == generated >= summary["groups_trained"]
    assert summary["generation_wasted_fraction"] == round(1 - summary["groups_trained"] / generated, 4)
    # the samplers' own count of groups the ingest acknowledged: every trained group (its ack came before the step),
    # and no more than the ingest took in (no prompts injected, no acknowledgement lost and resent here)
    accepted = sum(s["groups_accepted"] for s in summary["samplers"].values())
    assert summary["groups_trained"] <= accepted <= summary["groups_ingested"], (accepted, summary["samplers"])
    assert all(s["stream"]["accepted"] == s["groups_accepted"] for s in summary["samplers"].values())


def tensorboard_tags(event_dir: pathlib.Path) -> dict[str, str]:
    """Tag -> kind ("scalar" / "histogram") of every summary in the TFRecord event files of a directory."""
    import struct

    from tensorboardX.proto import event_pb2

    tags = {}
    for path in event_dir.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                tags[value.tag] = "histogram" if value.HasField("histo") else "scalar"
    return tags


@pytest.mark.parametrize("command", ["up", "trainer"])
def test_unreachable_redis_is_one_line_and_nonzero(tmp_path, command):
    from grpo_stream.common.rollouts.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    tokens = run_cli("tokens", "--out", str(tmp_path / "auth"), timeout=60)  # the trainer checks auth first
    assert tokens.returncode == 0, tokens.stderr
    proc = run_cli(command, "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(tmp_path / "r"),
                   f"redis.url={url}", "redis.connect_timeout_s=1", f"auth.tokens_file={tmp_path / 'auth/tokens.yaml'}",
                   timeout=180)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"redis.url={url}: not reachable after 1s" in lines[0], proc.stderr
    assert "(redis.url) not reachable" in proc.stdout and "retrying in" in proc.stdout  # it waited, logging


@pytest.mark.parametrize("args, message", [
    (["trainer.stepz=3"], "config error: trainer.stepz: unknown key"),
    (["trainer.steps"], "config error: override 'trainer.steps' is not KEY=VALUE"),
    (["sampler.replicas=0"], "config error: sampler.replicas: Input should be greater than or equal to 1"),
])
@pytest.mark.parametrize("command", ["up", "trainer", "sampler"])
def test_bad_config_is_one_line_and_nonzero(command, args, message):
    proc = run_cli(command, "--config", "configs/tiny_arith.yaml", *args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_help_does_not_import_jax():
    code = ("import sys; from grpo_stream.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'jax' not in sys.modules and 'tunix' not in sys.modules, 'heavy import in --help'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "up" in proc.stdout and "trainer" in proc.stdout and "sampler" in proc.stdout


def test_print_config_shows_resolved_values():
    proc = run_cli("trainer", "--config", "configs/tiny_arith.yaml", "--print-config", "trainer.steps=5", timeout=60)
    assert proc.returncode == 0 and "steps: 5" in proc.stdout


def test_report_on_a_missing_run_is_one_line(tmp_path):
    # exit 2: input the command cannot use (a directory no run wrote), as audit and status answer it
    proc = run_cli("report", str(tmp_path / "nope"), timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "metrics-trainer.jsonl" in proc.stderr


# an `up` run stopped and resumed (~120 s, stop 76); a clean stop by signal (test_run_dir_guard.py) and resuming
# (tests/integration/test_trainer_resume.py) stay in the default lane
@pytest.mark.heavy
def test_a_running_loop_serves_metrics_then_ctrl_c_stops_it_and_the_same_command_resumes(tmp_path):
    """While `up` runs (standalone ingest, JSON logs), the trainer's and both samplers' /metrics hold the named
    series. Then Ctrl-C as a terminal sends it, SIGINT to `up`'s whole process group, mid-run: the trainer finishes
    its step, checkpoints and writes the summary, every process exits 0 (the embedded Redis, in a group of its own,
    outlives them); `up` again on the same run directory resumes from that checkpoint, with the buffer kept in
    RUN_DIR/redis, and the audit finds every group accounted for."""
    import signal
    import time

    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "grpo_stream", "up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir",
            str(run_dir), "trainer.eval_after=false", "ingest.standalone=true", "logging.verbose=true"]
    trainer_port, sampler_port = _consecutive_free_ports(1), _consecutive_free_ports(2)
    proc = subprocess.Popen([*base, "trainer.steps=100000", f"trainer.metrics_port={trainer_port}",
                             f"sampler.metrics_port={sampler_port}", "logging.format=json"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)  # a group of its own, as a terminal's foreground job
    lines = []
    deadline = time.monotonic() + 300
    try:
        for line in proc.stdout:
            lines.append(line)
            if "step 3/" in line or time.monotonic() > deadline:
                break
        check_prometheus_series(trainer_port, sampler_port)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    text = "".join(lines) + out
    assert proc.returncode == 130, text[-3000:]
    check_json_logs(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert 3 <= stopped < 100000 and summary["stopped_early"] and summary["checkpoints_saved"][-1] == stopped
    assert summary["groups_ingested"] == (summary["groups_trained"] + summary["groups_dropped_stale"]
                                          + summary["groups_left_in_buffer"])
    assert all(code == 0 for code in summary["sampler_exit_codes"].values())
    assert "did not stop" not in text and "[ingest]" in text and "ingest stopped" in text

    again = subprocess.run([*base, f"trainer.steps={stopped + 3}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from"]["step"] == stopped and resumed["steps"] == stopped + 3
    assert resumed["groups_ingested"] > summary["groups_ingested"]  # the same buffer, grown
    audit = run_cli("audit", str(run_dir), timeout=120)
    assert audit.returncode == 0 and "0 lost; 0 trained twice" in audit.stdout, audit.stdout + audit.stderr
    assert "over 2 trainer starts (1 resumed" in audit.stdout


def check_prometheus_series(trainer_port: int, sampler_port: int) -> None:
    """Scrape /metrics of a running trainer (past step 3) and both samplers and find the named series."""
    import urllib.request

    def scrape(port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    trainer = scrape(trainer_port)
    for series in ("grpo_stream_trainer_step", "grpo_stream_buffer_depth", "grpo_stream_weight_version",
                   'grpo_stream_groups_total{outcome="ingested"}', "grpo_stream_reward_mean",
                   'grpo_stream_sampler_weight_lag{sampler="sampler-0"}', "grpo_stream_tokens_per_second",
                   "grpo_stream_groups_per_second", "grpo_stream_compute_share"):
        assert series in trainer, series
    step = next(float(line.split()[-1]) for line in trainer.splitlines()
                if line.startswith("grpo_stream_trainer_step "))
    assert step >= 3
    for k in range(2):
        sampler = scrape(sampler_port + k)
        for series in ("grpo_stream_sampler_groups_total", "grpo_stream_sampler_tokens_total",
                       "grpo_stream_sampler_weight_version", "grpo_stream_sampler_backlog",
                       "grpo_stream_sampler_weight_lag_seen", "grpo_stream_sampler_weight_fetch_failures"):
            assert series in sampler, (k, series)
        # the trainer's per-sampler name is the trainer's alone (one name, one meaning, across targets)
        assert "grpo_stream_sampler_weight_lag " not in sampler and "grpo_stream_sampler_weight_lag{" not in sampler


def check_json_logs(run_dir: pathlib.Path) -> None:
    """logging.format=json: every line a process logged is one JSON object."""
    for name in ("trainer", "sampler-0"):
        lines = (run_dir / "logs" / f"{name}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        assert records and len(records) == len([line for line in lines if line.strip()]), lines[:5]
        assert {"time", "process", "level", "logger", "message"} <= set(records[0])
        assert records[0]["process"] == name


def test_sampler_without_trainer_is_one_line_and_nonzero():
    from grpo_stream.common.rollouts.redis_server import free_port

    address = f"127.0.0.1:{free_port()}"
    proc = run_cli("sampler", "--config", "configs/tiny_arith_smoke.yaml", "--index", "0",
                   f"sampler.trainer_address={address}", "sampler.connect_timeout_s=1", timeout=180,
                   env={"GRPO_STREAM_TOKEN": "a-sampler-token-for-a-missing-trainer"})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"sampler.trainer_address={address}: trainer not reachable" in lines[0], proc.stderr


def _consecutive_free_ports(n: int) -> int:
    import socket

    for _ in range(50):
        from grpo_stream.common.rollouts.redis_server import free_port

        base = free_port()
        try:
            socks = []
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no consecutive free ports")


def test_eval_limit_must_be_positive():
    proc = run_cli("eval", "--config", "configs/tiny_arith_smoke.yaml", "--limit", "0", timeout=60)
    assert proc.returncode == 2 and "--limit: must be at least 1, got 0" in proc.stderr


@pytest.mark.redis
def test_sampler_waits_for_a_trainer_that_answers_but_has_not_published_then_gives_up_on_silence(tmp_path,
                                                                                               shared_redis, run_name,
                                                                                               monkeypatch):
    """A trainer in its warm start serves health but no weights: the sampler waits past connect_timeout_s and
    installs the first version when it comes; a trainer that goes silent ends it after connect_timeout_s."""
    import time

    from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
    from grpo_stream.common.config.loading import load_config
    from tests.support import deployment_auth, wait_for
    from grpo_stream.common.rollouts.redis_server import connect
    from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
    from grpo_stream.common.rollouts.wire import GroupLimits
    from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
    from grpo_stream.trainer_service.publication.publisher import WeightPublisher
    from grpo_stream.trainer_service.publication.weight_service import WeightService
    from grpo_stream.trainer_service.server import TrainerServer

    config = ROOT / "configs" / "tiny_arith_smoke.yaml"
    overrides = ["sampler.connect_timeout_s=2", "sampler.metrics_port=null", "sampler.weight_poll_s=0.05",
                 "logging.verbose=true"]  # the per-version "installed" lines
    cfg = load_config(config, overrides)
    _, tokenizer = build_task_and_tokenizer(cfg)
    named = build_policy(cfg, tokenizer.vocab_size, seed=0).to_named_numpy()
    gen = cfg.generation
    limits = GroupLimits(gen.num_generations, gen.max_prompt_tokens, gen.max_new_tokens, tokenizer.vocab_size)
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)  # the samplers' groups, if any, land here
    log_path = tmp_path / "sampler.log"

    def start(port: int):
        return subprocess.Popen([sys.executable, "-m", "grpo_stream", "sampler", "--config", str(config), "--index",
                                 "0", *overrides, f"trainer.port={port}"], cwd=ROOT, stdout=open(log_path, "w"),
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **auth})

    def running(proc) -> bool:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return True

    def wait_for_log(proc, text: str, timeout_s: float = 120) -> None:
        wait_for(lambda: running(proc) and text in log_path.read_text(), timeout_s, f"{text!r} in the sampler's log",
                 interval_s=0.1)

    asked: list[float] = []

    class Watched(WeightService):
        """Notes when the sampler asks for the manifest (NOT_FOUND while nothing is published)."""

        def GetManifest(self, request, context):
            asked.append(time.monotonic())
            return super().GetManifest(request, context)

    monkeypatch.setattr("grpo_stream.trainer_service.server.WeightService", Watched)
    auth, security = deployment_auth(tmp_path / "auth")
    publisher = WeightPublisher()
    server = TrainerServer(IngestServicer(buffer, limits, 1000, 20), publisher, "127.0.0.1", 0, security=security)
    proc = start(server.start())
    try:
        wait_for_log(proc, "connected to")
        # Not giving up is an absence, so it takes time: the sampler must keep asking for weights over three times
        # connect_timeout_s (it checks the trainer's health every second while it waits). Timed by its own requests,
        # so a sampler the loaded machine starves of CPU is not mistaken for one that waited.
        wait_for(lambda: running(proc) and asked and asked[-1] - asked[0] > 6, 120,
                 "the sampler to wait 3x connect_timeout_s for the first weights")
        publisher.publish_arrays(0, named)
        wait_for_log(proc, "installed weight version 0")
        publisher.publish_arrays(1, named, final=True)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop(0)

    silent = TrainerServer(IngestServicer(buffer, limits, 1000, 20), WeightPublisher(), "127.0.0.1", 0,
                           security=security)
    proc = start(silent.start())
    try:
        wait_for_log(proc, "connected to")
        silent.stop(0)  # the trainer dies before publishing anything
        assert proc.wait(timeout=60) == 1
        assert "the trainer stopped answering for 2s (sampler.connect_timeout_s)" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("command", ["trainer", "ingest"])
def test_a_server_without_a_token_table_fails_at_once_naming_the_settings(command, tmp_path):
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_STREAM_TOKEN")}
    args = [sys.executable, "-m", "grpo_stream", command, "--config", "configs/tiny_arith_smoke.yaml",
            "redis.url=redis://127.0.0.1:1/0", *(["--run-dir", str(tmp_path / "r")] if command == "trainer" else [])]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env_free)
    assert proc.returncode == 1
    assert "auth.mode=tokens but no token table: set $GRPO_STREAM_TOKENS_FILE or auth.tokens_file" in proc.stderr
    assert "not reachable" not in proc.stdout  # it did not wait for Redis first


@pytest.mark.heavy  # another `up` run (50 s); the dtype casts have unit tests in the default lane
def test_samplers_generate_in_their_own_dtype(tmp_path):
    """sampler.dtype=bfloat16 beside a float32 trainer: every published version is cast on arrival, the run's
    accounting holds, and the behaviour logprobs differ from the trainer's float32 recomputation at version lag 0 by
    bfloat16's precision (which a float32 sampler matches to 1e-5: tests/e2e/test_demo.py)."""
    run_dir = tmp_path / "run"
    proc = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir),
                   "sampler.dtype=bfloat16", "trainer.eval_before=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=2, steps=8)
    agreement = summary["logprob_agreement_lag0"]
    assert agreement["tokens"] > 0
    assert 1e-4 < agreement["mean_abs"] < 0.5, agreement
