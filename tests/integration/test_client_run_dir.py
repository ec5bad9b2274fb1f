"""The client commands given --run-dir against a real PromptService and Redis: the address is the one the run's
endpoints.json names now (each start of `up` serves on new ports and rewrites it), and a broken endpoints.json is
named."""

import json
import pathlib
import subprocess
import sys
import threading

import pytest

from grpo_stream.cli import main
from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.common.runtime.files import write_atomic
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.trainer_service.ingest.server import ingest_servicers
from grpo_stream.trainer_service.server import TrainerServer
from tests.support import answer, serve, stop_process, wait_for, with_run_name

pytestmark = pytest.mark.redis
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as s:
        yield s


def endpoints(run_dir: pathlib.Path, stack) -> None:
    """RUN_DIR/endpoints.json as `up` writes it at each start."""
    write_atomic(run_dir / "endpoints.json", json.dumps({"prompts": stack.address, "tls": False,
                                                         "client_token_file": str(stack.tokens["client"])}))


def answer_one(stack) -> None:
    ingest = rollout_pb2_grpc.RolloutIngestStub(stack.channel("sampler"))
    claim = rollout_pb2.ClaimRequest(sampler_id="sampler-0", max_prompts=1)
    for prompt in ingest.ClaimPrompts(claim, wait_for_ready=True, timeout=30).prompts:
        assert ingest.PushGroup(to_proto(answer(prompt, stack.cfg.run.name)), wait_for_ready=True, timeout=30).code == 0


def test_following_with_run_dir_finds_the_run_restarted_on_new_ports(stack, tiny_parts, tmp_path):
    """`up` stopped and started again (a resume) serves on new ports and rewrites endpoints.json: `results IDS
    --run-dir D` kept calling the address it read at its start, found nothing there, and failed UNAVAILABLE after
    --wait (exit 1) with the run back and the prompts' results waiting."""
    _, task, tokenizer, _ = tiny_parts
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    endpoints(run_dir, stack)
    with PromptClient(stack.address, ClientSecurity(stack.token("client"))) as client:
        ids = client.submit([{"text": "Q: 1 + 1 A:"}, {"text": "Q: 2 + 2 A:"}])
    proc = subprocess.Popen([sys.executable, "-m", "grpo_stream", "results", *ids, "--run-dir", str(run_dir),
                             "--wait", "30"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed = []
    reader = threading.Thread(target=lambda: printed.extend(json.loads(line)["prompt_id"] for line in proc.stdout),
                              daemon=True)
    reader.start()
    again = None
    try:
        answer_one(stack)
        wait_for(lambda: printed or proc.poll() is not None, 60, "the first result")
        stack.server.stop(0)  # the run stopped; started again on another port
        ingest, prompts = ingest_servicers(stack.cfg, stack.buffer, task, tokenizer, stack.server.security)
        again = TrainerServer(ingest, stack.publisher, "127.0.0.1", 0, security=stack.server.security,
                              prompts=prompts)
        stack.address, stack.server = f"127.0.0.1:{again.start()}", again
        endpoints(run_dir, stack)
        answer_one(stack)
        proc.wait(timeout=120)  # (not communicate: the reader thread has stdout)
    finally:
        stop_process(proc, 10)
        if again is not None:
            again.stop(0)
    reader.join(10)
    assert proc.returncode == 0, proc.stderr.read()
    assert sorted(printed) == sorted(ids)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"prompts": 5}', "\udcff"])
def test_an_endpoints_file_up_did_not_write_is_named(text, tmp_path, capsys):
    """A broken endpoints.json was a bare "Expecting value: line 1 column 1" naming no file, or an AttributeError
    traceback (a list) as if the command had a bug."""
    (tmp_path / "endpoints.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert main(["status", "--run-dir", str(tmp_path), "--wait", "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'endpoints.json'}:" in err and "give --address" in err and "Traceback" not in err
