"""`grpo-stream submit` against a real PromptService and Redis whose per-client quota is smaller than a Submit call:
the call can never fit, so it is refused at once, naming the --batch that does."""

import json

import pytest

from grpo_stream.cli import main
from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from tests.support import serve, with_run_name

pytestmark = pytest.mark.redis
QUOTA = 5


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    cfg = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"max_pending_per_client": QUOTA})})
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as s:
        (tmp_path / "client.token").write_text(s.token("client"))
        yield s


def test_a_call_larger_than_the_quota_is_refused_at_once_naming_the_batch_that_fits(stack, tmp_path, capsys):
    """A call of more prompts than prompts.max_pending_per_client was retried for a minute without a word (it can
    never fit, however many prompts finish), then reported as a full quota to retry later (exit 1): the fix is a
    smaller --batch."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": f"Q: {i} + 1 A:"}) + "\n" for i in range(QUOTA + 2)))
    assert main(["submit", str(path), "--address", stack.address, "--token-file", str(tmp_path / "client.token")]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"prompt_ids": [], "complete": False, "failed_from_line": 1}
    assert f"give --batch at most {QUOTA}" in err and "RESOURCE_EXHAUSTED" in err
    assert stack.server.ingest.injection.queue.counts() == (0, 0)


def test_only_a_call_larger_than_the_quota_is_taken_for_one_that_never_fits(stack):
    """A call refused because the client's earlier prompts are unfinished fits once they finish: still retried."""
    from grpo_stream.client.errors import never_fits  # noqa: PLC0415 - what the fix added

    def refusal(prompts: int):
        with PromptClient(stack.address, ClientSecurity(stack.token("client"))) as client:
            try:
                client.submit([{"text": f"Q: {i} + 2 A:"} for i in range(prompts)], retry_s=0)
            except Exception as exc:  # noqa: BLE001 - examined below
                return exc
        return None

    assert never_fits(refusal(QUOTA + 1)) == ("prompts.max_pending_per_client", QUOTA)
    assert refusal(QUOTA - 1) is None
    error = refusal(2)
    assert "prompts.max_pending_per_client" in error.details() and never_fits(error) is None
