"""`up`'s tokens: a run makes one token per sampler, each sampler process gets its own (so it can send only as its
own sampler id), and a run directory made before per-sampler tokens keeps working with the shared one."""

import pathlib

import yaml

from grpo_stream.common.config.access import TOKEN_FILE_ENV, TOKENS_ENV
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rpc.auth import MAX_REPLICA, Caller, TokenTable, may_act_as
from grpo_stream.up.run_secrets import sampler_token_env, with_run_tokens
from tests.conftest import CONFIGS


def test_each_sampler_process_gets_its_own_token(tmp_path):
    cfg = load_config(CONFIGS / "tiny_arith.yaml", ["sampler.replicas=3"])
    servers, samplers, client = with_run_tokens(cfg, tmp_path, {})
    table = TokenTable.from_file(servers[TOKENS_ENV])
    rows = yaml.safe_load(pathlib.Path(servers[TOKENS_ENV]).read_text())
    assert sorted(r["name"] for r in rows if r["role"] == "sampler") == ["sampler", "sampler-0", "sampler-1",
                                                                           "sampler-2"]
    files = [pathlib.Path(sampler_token_env(samplers, i)[TOKEN_FILE_ENV]) for i in range(3)]
    assert [f.name for f in files] == ["sampler-0.token", "sampler-1.token", "sampler-2.token"]
    tokens = {f.read_text().strip() for f in files}
    assert len(tokens) == 3 and pathlib.Path(client).name == "client.token"
    assert table.lookup(files[1].read_text().strip()) == Caller("sampler-1", "sampler")


def test_a_run_made_before_per_sampler_tokens_keeps_the_shared_one(tmp_path):
    cfg = load_config(CONFIGS / "tiny_arith.yaml", ["sampler.replicas=2"])
    _, samplers, _ = with_run_tokens(cfg, tmp_path, {})
    for i in range(2):
        (tmp_path / "auth" / f"sampler-{i}.token").unlink()
    assert pathlib.Path(sampler_token_env(samplers, 1)[TOKEN_FILE_ENV]).name == "sampler.token"


def test_who_may_act_as_which_sampler():
    shared, own, client, admin = (Caller("sampler", "sampler"), Caller("sampler-1", "sampler"),
                                  Caller("alice", "client"), Caller("ops", "admin"))
    assert may_act_as(shared, "sampler-0") and may_act_as(shared, "sampler-12") and may_act_as(shared, "sampler")
    assert may_act_as(own, "sampler-1") and not may_act_as(own, "sampler-0") and not may_act_as(own, "sampler-12")
    assert not may_act_as(shared, "sampler-x") and not may_act_as(shared, "other-0")
    # one id per replica k, at most MAX_REPLICA + 1 of them: a token cannot claim prompts under unboundedly many ids
    assert may_act_as(shared, f"sampler-{MAX_REPLICA}") and not may_act_as(shared, f"sampler-{MAX_REPLICA + 1}")
    assert not may_act_as(shared, "sampler-007") and not may_act_as(shared, "sampler-\u0663")  # Arabic-Indic 3
    assert not may_act_as(client, "alice") and may_act_as(admin, "anything")
