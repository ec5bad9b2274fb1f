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
