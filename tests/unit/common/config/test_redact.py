"""Secret-looking values of the config's free-form dicts are hidden from `config show`, `--print-config` and W&B."""

import subprocess
import sys

from grpo_stream.common.config.loading import load_config, to_yaml
from grpo_stream.common.config.redact import REDACTED, redacted, secret_key

SECRETS = ["task.verifiers.args.api_key=sk-live-1", "task.verifiers.args.client.OPENAI_API_KEY=sk-live-2",
           "task.verifiers.args.headers={Authorization: Bearer sk-live-3}", "sampler.vllm.engine_args.hf_token=hf_4",
           "task.verifiers.args.db.password=pw-5", "task.verifiers.args.apiKey=sk-live-6"]


def test_secret_keys_lose_their_values_at_any_depth_and_the_rest_is_kept():
    for name in ("api_key", "apiKey", "OPENAI_API_KEY", "hf_token", "password", "client-secret", "Authorization",
                 "credentials", "private_key"):
        assert secret_key(name), name
    for name in ("tokens_file", "max_tokens", "key", "num_tokens", "secrets_dir_mode", "path"):
        assert not secret_key(name), name
    data = {"a": {"api_key": "x", "nested": [{"token": "y", "n": 1}], "max_tokens": 5, "password": None}}
    assert redacted(data) == {"a": {"api_key": REDACTED, "nested": [{"token": REDACTED, "n": 1}], "max_tokens": 5,
                                    "password": None}}


def test_config_show_and_print_config_hide_them():
    text = to_yaml(load_config(None, SECRETS), redact=True)
    assert "sk-live" not in text and "hf_4" not in text and "pw-5" not in text and text.count(REDACTED) == 6
    for argv in (["config", "show", *SECRETS], ["trainer", "--print-config", *SECRETS]):
        out = subprocess.run([sys.executable, "-m", "grpo_stream", *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "sk-live" not in out.stdout and REDACTED in out.stdout, out.stderr[-2000:]


def test_api_key_headers_secret_key_and_lists_of_keys_are_hidden_too():
    """`x-api-key` (Anthropic's header), `api-key` (Azure OpenAI's), SECRET_KEY and a list under `api_keys` were
    printed whole by `config show` and sent to W&B."""
    for name in ("x-api-key", "X-Api-Key", "api-key", "SECRET_KEY", "api_keys", "access-key", "passphrase"):
        assert secret_key(name), name
    for name in ("keys", "cache_key", "monkey", "api_key_file"):
        assert not secret_key(name), name
    cfg = load_config(None, ["task.verifiers.args.headers={x-api-key: sk-a1, api-key: sk-a2}",
                             "task.verifiers.args.api_keys=[sk-a3, sk-a4]", "sampler.vllm.engine_args.SECRET_KEY=sk-a5",
                             "task.verifiers.args.credentials={user: me, password: sk-a6}"])
    text = to_yaml(cfg, redact=True)
    assert "sk-a" not in text and text.count(REDACTED) == 6 and "user: me" in text


def test_an_override_with_a_secret_inside_its_mapping_value_is_shown_redacted():
    """For `up`'s record of the overrides (RUN_DIR/config.yaml's header): a mapping value kept its API key."""
    from grpo_stream.common.config.loading import redacted_override

    assert redacted_override("task.verifiers.args={api_key: sk-1, n: 2}") == \
        'task.verifiers.args={"api_key": "<redacted>", "n": 2}'
    assert redacted_override("task.verifiers.args.headers.x-api-key=sk-2").endswith(f"x-api-key={REDACTED}")
    assert redacted_override("trainer.steps=3") == "trainer.steps=3"


def test_a_mapping_under_a_secret_named_key_that_names_no_secret_is_hidden_whole():
    """`api_keys: {openai: sk-..., anthropic: sk-...}` kept its keys' values in `config show`, RUN_DIR/config.yaml
    (readable by all) and W&B's config: only secret-named keys inside a secret-named mapping were hidden. A mapping
    that names its secrets (`credentials: {user, password}`) still shows the rest."""
    from grpo_stream.common.config.loading import redacted_override

    cfg = load_config(None, ["task.verifiers.args.api_keys={openai: sk-b1, anthropic: sk-b2}",
                             "task.verifiers.args.credentials={user: me, password: sk-b3}"])
    text = to_yaml(cfg, redact=True)
    assert "sk-b" not in text and text.count(REDACTED) == 3 and "openai: " in text and "user: me" in text
    assert redacted_override("task.verifiers.args.api_keys.openai=sk-b4") == \
        f"task.verifiers.args.api_keys.openai={REDACTED}"
