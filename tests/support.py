"""Helpers for the tests: waiting for a condition, a clock tests move by hand, a config's run name; and a trainer's
gRPC server as a run configures it (ingest, PromptService, weights, health, reflection, auth, TLS), on loopback with
a real Redis, for the integration tests of prompts, auth, TLS and fuzzing."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import subprocess
import threading
import time

import numpy as np

from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rpc.grpc_util import ClientSecurity, ServerSecurity, open_channel
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.weights.snapshot import WeightSnapshot
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.ingest.server import ingest_servicers
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer


def child_report(module: str, devices: int) -> dict:
    """The JSON a test helper module prints when run as its own process with `devices` fake CPU devices (a device
    count is fixed per process, so tests of meshes run their body there)."""
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from grpo_stream.plan.memory import child_env  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", module], cwd=root, env=child_env(devices), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def stop_process(proc, grace_s: float = 60.0) -> None:
    """SIGTERM a process still running (`up` stops its children, which run in their own sessions, before exiting),
    then SIGKILL it after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate` until it returns something truthy, and return that; AssertionError naming `what` (and the
    last value) when timeout_s passes first. An exception from the predicate (e.g. an assert that a process is still
    running) ends the wait at once. Tests wait this way, never by sleeping a fixed time and hoping."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what} (last: {value!r})")
        time.sleep(interval_s)


def in_thread(fn, within_s: float) -> tuple[bool, object]:
    """fn() on a daemon thread: (whether it ended within `within_s`, what it returned or raised; None while running)."""
    out = []

    def run():
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    return not thread.is_alive(), (out or [None])[0]


class FakeClock:
    """A clock for code that takes `clock=` (lease and back-off deadlines): time moves only when the test says."""

    def __init__(self, now: float | None = None):
        self.now = time.time() if now is None else now  # near the real time, so timestamps in records look right

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Aborted(Exception):
    """What AbortingContext.abort raises (grpc's does the same: abort never returns)."""


class AbortingContext:
    """A servicer's grpc context for calling a servicer method directly: abort records the code and details and
    raises Aborted."""

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def with_run_name(cfg, name: str):
    """`cfg` for run `name` (tests on the shared Redis each take their own: conftest's `run_name`)."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})


@dataclasses.dataclass
class Stack:
    cfg: object
    server: TrainerServer
    buffer: RedisStreamBuffer
    publisher: WeightPublisher
    tokens: dict[str, pathlib.Path]
    address: str

    def token(self, role: str) -> str:
        return self.tokens[role].read_text().strip()

    def channel(self, role: str | None, token: str | None = None, cfg=None):
        """A channel with `role`'s token (or `token`; None: no token) and the run's TLS client settings."""
        security = ClientSecurity.from_config(cfg or self.cfg, token="")  # the TLS settings; the token is ours
        token = token if token is not None else (self.token(role) if role else None)
        return open_channel(self.address, dataclasses.replace(security, token=token))


def deployment_auth(out_dir: pathlib.Path) -> tuple[dict[str, str], ServerSecurity]:
    """Tokens as a deployment hands them out: (environment for service processes: the servers' table and the
    sampler token, security for a server the test runs itself)."""
    from grpo_stream.common.rpc.auth import TokenTable  # noqa: PLC0415

    tokens = write_tokens(out_dir)
    env = {"GRPO_STREAM_TOKENS_FILE": str(tokens["table"]), "GRPO_STREAM_TOKEN_FILE": str(tokens["sampler"])}
    return env, ServerSecurity(TokenTable.from_file(tokens["table"]))


@contextlib.contextmanager
def serve(cfg, redis_url: str, tokens_dir: pathlib.Path, task, tokenizer, data_plane: bool = False,
          publish: bool = True):
    """A running server for `cfg` (auth.mode=tokens with a fresh table in tokens_dir unless cfg says otherwise)."""
    tokens = write_tokens(tokens_dir)
    if cfg.auth.mode == "tokens" and not cfg.auth.tokens_file:
        cfg = cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"tokens_file": str(tokens["table"])})})
    security = ServerSecurity.from_config(cfg)
    buffer = RedisStreamBuffer(connect(redis_url, 5), cfg.run.name)
    ingest, prompts = ingest_servicers(cfg, buffer, task, tokenizer, security)
    publisher = WeightPublisher(chunk_bytes=1 << 16)
    if publish:
        publisher.publish(WeightSnapshot(0, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, False, "", 0.0))
    server = TrainerServer(ingest, publisher, "127.0.0.1", 0, security=security, prompts=prompts,
                           data_port=0 if data_plane else None)
    port = server.start()
    try:
        yield Stack(cfg, server, buffer, publisher, tokens, f"127.0.0.1:{port}")
    finally:
        server.stop(0)


def answer(prompt, run_name: str, sampler_id: str = "sampler-0", version: int = 0, reward: float = 1.0) -> GroupData:
    """A scored group answering an injected prompt (what a sampler sends back)."""
    comps = [CompletionData(np.array([5, 6, 7], np.int32), np.array([-0.1, -0.2, -0.3], np.float32), reward, False)
             for _ in range(prompt.num_generations)]
    return GroupData(f"{run_name}/inj/{prompt.prompt_id}", prompt.prompt_id,
                     np.array(prompt.prompt_token_ids, np.int32), comps, version, sampler_id, injected=True)


def command_lines() -> list[bytes]:
    """Every process's argv, as `ps` shows them to any user."""
    out = []
    for path in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(path.read_bytes())
        except OSError:  # exited meanwhile
            continue
    return out


def endpoint_overrides(model_dir, tokens_table, *extra: str) -> list[str]:
    """A small sampler serving `model_dir` (float32, 8 slots, 96 prompt tokens, 8 new) over the OpenAI endpoint as
    `policy`, callers from `tokens_table`: the endpoint tests' run, with `extra` overrides after."""
    return ["model.kind=hf", f"model.path={model_dir}", "model.dtype=float32", "generation.max_prompt_tokens=96",
            "generation.max_new_tokens=8", "generation.decode_slots=8", "sampler.rows_in_flight=8",
            "generation.decode_chunk_steps=4", "warmstart.steps=0", "sampler.openai.port=0",
            "sampler.openai.model_name=policy", f"auth.tokens_file={tokens_table}", *extra]
