"""`grpo-stream submit / status / results / cancel` as a user runs them (grpo_stream.cli.main, or a real process for
Ctrl-C) against a real PromptService and Redis: partial submits, refusals named by file line, exit codes by status
code, following across a server restart."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from grpo_stream.cli import main
from grpo_stream.client import prompts
from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.trainer_service.ingest import prompt_service
from grpo_stream.trainer_service.ingest.server import ingest_servicers
from grpo_stream.trainer_service.server import TrainerServer
from tests.support import answer, serve, with_run_name

pytestmark = pytest.mark.redis
ROOT = pathlib.Path(__file__).resolve().parents[2]


def served(tiny_parts, redis_url: str, run_name: str, tmp_path, **prompts):
    """A PromptService and ingest on a real Redis, with these prompts.* settings, and the client's token file."""
    cfg, task, tokenizer, _ = tiny_parts
    cfg = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update=prompts)})
    with serve(with_run_name(cfg, run_name), redis_url, tmp_path / "auth", task, tokenizer) as s:
        (tmp_path / "client.token").write_text(s.token("client"))
        yield s


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    yield from served(tiny_parts, shared_redis.url, run_name, tmp_path, max_pending_per_client=20)


def cli(stack, tmp_path, *argv) -> int:
    return main([*argv, "--address", stack.address, "--token-file", str(tmp_path / "client.token")])


def prompts_file(tmp_path, lines: list[str]) -> pathlib.Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def answer_all(stack, n: int) -> None:
    ingest = rollout_pb2_grpc.RolloutIngestStub(stack.channel("sampler"))
    claim = rollout_pb2.ClaimRequest(sampler_id="sampler-0", max_prompts=n)
    for prompt in ingest.ClaimPrompts(claim, wait_for_ready=True, timeout=30).prompts:  # a server restarting
        assert ingest.PushGroup(to_proto(answer(prompt, stack.cfg.run.name)), wait_for_ready=True, timeout=30).code == 0


def test_ctrl_c_during_submit_prints_the_ids_of_the_prompts_already_queued(stack, tmp_path):
    """The third call waits for quota (20 unfinished per client): Ctrl-C there left 20 prompts queued and printed no
    id, so neither a rerun (queues them twice) nor a cancel was possible."""
    path = prompts_file(tmp_path, [json.dumps({"text": f"Q: {i} + 1 A:", "tags": ["sig"]}) for i in range(25)])
    proc = subprocess.Popen([sys.executable, "-m", "grpo_stream", "submit", str(path), "--batch", "10", "--address",
                             stack.address, "--token-file", str(tmp_path / "client.token")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    queue = stack.server.ingest.injection.queue
    deadline = time.monotonic() + 60
    while len(queue.tagged("sig")) < 20 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # into the retry wait of the third call
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    printed = json.loads(out.splitlines()[-1])
    assert sorted(printed["prompt_ids"]) == sorted(queue.tagged("sig")) and len(printed["prompt_ids"]) == 20
    assert printed["failed_from_line"] == 21 and printed["complete"] is False
    assert "resubmit from line 21 on" in err


def test_print_config_on_a_client_command_prints_the_config_and_connects_to_nothing(tmp_path, capsys):
    path = prompts_file(tmp_path, ['{"text": "Q: 1 + 1 A:"}'])
    assert main(["submit", str(path), "--address", "127.0.0.1:1", "--print-config", "tls.server_name=x"]) == 0
    out = capsys.readouterr().out
    assert "run:" in out and "server_name: x" in out
    assert main(["status", "--address", "127.0.0.1:1", "--print-config"]) == 0
    with pytest.raises(SystemExit) as exit_:  # -v would log nothing here: not offered rather than ignored
        main(["submit", str(path), "--address", "127.0.0.1:1", "-v"])
    assert exit_.value.code == 2


def test_a_refused_prompt_is_named_by_its_line_in_the_file_and_exits_2(stack, tmp_path, capsys):
    """With a blank line inside the call, the server's prompts[1] is line 3, not "line 1 + 1"."""
    path = prompts_file(tmp_path, ['{"text": "Q: 1 + 1 A:"}', "", '{"text": "Q: 3 + 3 A:", "priority": 50}'])
    assert cli(stack, tmp_path, "submit", str(path), "--batch", "2") == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"prompt_ids": [], "complete": False, "failed_from_line": 1}
    assert f"INVALID_ARGUMENT: {path}:3: priority: 50 outside 0..9" in err and "prompts[" not in err
    assert "was refused: none of its prompts is queued" in err


@pytest.mark.parametrize("batch", ["0", "-1"])
def test_a_batch_below_1_is_refused_naming_the_option(batch, tmp_path, capsys):
    path = prompts_file(tmp_path, ['{"text": "Q: 1 + 1 A:"}'])
    with pytest.raises(SystemExit) as exit_:
        main(["submit", str(path), f"--batch={batch}", "--address", "127.0.0.1:1"])
    assert exit_.value.code == 2
    assert f"argument --batch: must be at least 1, got {batch}" in capsys.readouterr().err


def test_a_full_quota_and_a_dead_server_are_worded_as_such_not_as_bad_input(stack, tmp_path, capsys, monkeypatch):
    path = prompts_file(tmp_path, [json.dumps({"text": f"Q: {i} + 1 A:"}) for i in range(21)])
    monkeypatch.setattr(PromptClient.submit, "__defaults__", (0.0,))  # no retrying of a full quota
    assert cli(stack, tmp_path, "submit", str(path), "--batch", "20") == 1
    err = capsys.readouterr().err
    assert "RESOURCE_EXHAUSTED: the run's prompt queue or this client's quota" in err and "retry later" in err
    assert main(["status", "--address", "127.0.0.1:9", "--wait", "0.5", "--token-file",
                 str(tmp_path / "client.token")]) == 1
    err = capsys.readouterr().err
    assert "no answer from 127.0.0.1:9" in err and "is a run listening there?" in err


def test_unknown_or_foreign_ids_exit_2(stack, tmp_path, capsys):
    assert cli(stack, tmp_path, "results", "no-such-id") == 2
    assert "NOT_FOUND" in capsys.readouterr().err


def restart(stack, task, tokenizer) -> TrainerServer:
    """The stack's server stopped and, a second later, a new one on its port (a trainer restarted by `up`)."""
    port = int(stack.address.rsplit(":", 1)[1])
    stack.server.stop(0)
    ingest, prompts = ingest_servicers(stack.cfg, stack.buffer, task, tokenizer, stack.server.security)
    again = TrainerServer(ingest, stack.publisher, "127.0.0.1", port, security=stack.server.security, prompts=prompts)
    time.sleep(1.0)
    again.start()
    stack.server = again
    return again


def test_follow_resumes_across_a_server_restart_and_prints_each_result_once(stack, tiny_parts, tmp_path, capsys):
    """A trainer restarted by `up` ended every follower; now the stream is called again for what is unanswered."""
    _, task, tokenizer, _ = tiny_parts
    path = prompts_file(tmp_path, ['{"text": "Q: 1 + 1 A:"}', '{"text": "Q: 2 + 2 A:"}'])
    codes = []
    follower = threading.Thread(target=lambda: codes.append(cli(stack, tmp_path, "submit", str(path), "--follow")))
    follower.start()
    queue = stack.server.ingest.injection.queue
    while sum(queue.counts()) < 2:
        time.sleep(0.05)
    answer_all(stack, 1)  # one answered before the restart, one after
    time.sleep(1.0)
    again = restart(stack, task, tokenizer)
    try:
        answer_all(stack, 1)
        follower.join(30)
    finally:
        again.stop(0)
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert codes == [0], err
    assert sorted(r["prompt_id"] for r in lines[1:]) == sorted(lines[0]["prompt_ids"])  # each once
    assert "following again" in err


def test_results_and_cancel_commands(stack, tmp_path, capsys):
    client = PromptClient(stack.address, ClientSecurity(stack.token("client")))
    a, b = client.submit([{"text": "Q: 1 + 1 A:", "tags": ["t"]}, {"text": "Q: 2 + 2 A:"}])
    assert cli(stack, tmp_path, "cancel", b) == 0
    assert json.loads(capsys.readouterr().out) == {"cancelled": [b], "finished": []}
    answer_all(stack, 1)
    assert cli(stack, tmp_path, "results", a, b) == 0
    states = {r["prompt_id"]: r["state"] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert states == {a: "done", b: "cancelled"}
    assert cli(stack, tmp_path, "results", "--tag", "t") == 0
    assert [json.loads(line)["prompt_id"] for line in capsys.readouterr().out.splitlines()] == [a]


@pytest.fixture
def small_batch_stack(tiny_parts, shared_redis, run_name, tmp_path):
    """A run whose server takes at most 4 prompts (or ids) per call: prompts.max_batch."""
    yield from served(tiny_parts, shared_redis.url, run_name, tmp_path, max_batch=4)


def test_cancelling_more_ids_than_one_call_takes_cancels_them_all_in_calls_of_batch(small_batch_stack, tmp_path,
                                                                                   capsys):
    """More ids than the server's prompts.max_batch were refused whole (INVALID_ARGUMENT), though `submit` had
    queued them in calls of --batch: none could be cancelled in one command."""
    client = PromptClient(small_batch_stack.address, ClientSecurity(small_batch_stack.token("client")))
    ids = client.submit([{"text": f"Q: {i} + 1 A:"} for i in range(4)]) + client.submit([{"text": "Q: 9 + 9 A:"}])
    assert cli(small_batch_stack, tmp_path, "cancel", *ids, "--batch", "4") == 0
    assert json.loads(capsys.readouterr().out) == {"cancelled": ids, "finished": []}
    more = client.submit([{"text": f"Q: {i} + 2 A:"} for i in range(4)])
    assert cli(small_batch_stack, tmp_path, "cancel", *more, "no-such-id", "--batch", "4") == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"cancelled": more, "finished": [], "complete": False, "failed_from": "no-such-id"}
    assert "NOT_FOUND" in err and "was refused: it cancelled none of them; rerun from 'no-such-id' on" in err
    assert cli(small_batch_stack, tmp_path, "cancel", *ids, *more, "--batch", "5") == 2
    assert "give --batch at most that" in capsys.readouterr().err


def test_a_tls_run_dir_without_its_config_is_refused_naming_config(tmp_path, capsys):
    (tmp_path / "endpoints.json").write_text(json.dumps({"prompts": "127.0.0.1:1", "tls": True}))
    assert main(["status", "--run-dir", str(tmp_path)]) == 2
    assert f"give --config {tmp_path / 'config.yaml'}" in capsys.readouterr().err


def test_following_a_tag_resumes_across_a_server_restart_and_prints_each_result_once(stack, tiny_parts, tmp_path):
    """`results --tag T --follow` ended with UNAVAILABLE (exit 1) at a trainer restart, although following resumes
    across one (README); the new call streams the tag's finished results again, each printed once."""
    _, task, tokenizer, _ = tiny_parts
    client = PromptClient(stack.address, ClientSecurity(stack.token("client")))
    first, second = client.submit([{"text": "Q: 1 + 1 A:", "tags": ["t"]}, {"text": "Q: 2 + 2 A:", "tags": ["t"]}])
    proc = subprocess.Popen([sys.executable, "-m", "grpo_stream", "results", "--tag", "t", "--follow", "--address",
                             stack.address, "--token-file", str(tmp_path / "client.token"), "--wait", "30"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed = []
    threading.Thread(target=lambda: printed.extend(json.loads(line)["prompt_id"] for line in proc.stdout),
                     daemon=True).start()

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 30
        while len(printed) < n and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    try:
        answer_all(stack, 1)  # one answered before the restart, one after
        wait_for(1)
        again = restart(stack, task, tokenizer)
        try:
            answer_all(stack, 1)
            wait_for(2)
            time.sleep(0.5)  # a repeat of the first would show by now
            assert proc.poll() is None, proc.stderr.read()
        finally:
            again.stop(0)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    client.close()
    assert printed == [first, second] or printed == [second, first], err
    assert "following again" in err


def test_an_empty_token_file_is_named(tmp_path, capsys):
    """An empty --token-file was sent as no token at all: the server's UNAUTHENTICATED (or no server's timeout)
    did not say which file was wrong."""
    (tmp_path / "empty.token").write_text("\n")
    assert main(["status", "--address", "127.0.0.1:9", "--wait", "0.5", "--token-file",
                 str(tmp_path / "empty.token")]) == 2
    assert f"--token-file {tmp_path / 'empty.token'}: the file is empty" in capsys.readouterr().err


def test_results_of_more_ids_than_one_stream_may_name_are_followed_in_turns(stack, tmp_path, capsys, monkeypatch):
    """Following more ids than the server's MAX_IDS (10,000) in one StreamResults was refused INVALID_ARGUMENT (exit
    2), after `submit --follow` had queued them all; limits of 2 stand in for 10,000 here."""
    monkeypatch.setattr(prompt_service, "MAX_IDS", 2)
    monkeypatch.setattr(prompts, "FOLLOW_AT_ONCE", 2, raising=False)
    path = prompts_file(tmp_path, [json.dumps({"text": f"Q: {i} + 1 A:"}) for i in range(5)])
    assert cli(stack, tmp_path, "submit", str(path)) == 0
    ids = json.loads(capsys.readouterr().out)["prompt_ids"]
    answer_all(stack, 3)  # some answered before following, the rest while it follows
    later = threading.Timer(1.0, answer_all, (stack, 5))
    later.start()
    try:
        assert cli(stack, tmp_path, "results", *ids) == 0, capsys.readouterr().err
    finally:
        later.join(30)
    printed = [json.loads(line)["prompt_id"] for line in capsys.readouterr().out.splitlines()]
    assert sorted(printed) == sorted(ids)  # each once


def test_a_reader_that_stops_reading_ends_results_quietly(stack, tmp_path):
    """`grpo-stream results --tag t | head -1` exited 2 with "error: [Errno 32] Broken pipe", as if its input were
    bad."""
    client = PromptClient(stack.address, ClientSecurity(stack.token("client")))
    client.submit([{"text": "Q: 1 + 1 A:", "tags": ["t"]}])
    client.close()
    answer_all(stack, 1)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "grpo_stream", "results", "--tag", "t", "--address",
                               stack.address, "--token-file", str(tmp_path / "client.token")], cwd=ROOT,
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")
