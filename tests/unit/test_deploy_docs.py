"""The deployment files as a user meets them: the commands their headers tell a user to type, typed as a shell
types them (bash expands a `~` only at the start of a word or after the `=` of a shell assignment, never inside a
dotted override), and the numbers the code holds about them. (The files themselves: test_deploy_files.py.)"""

import pathlib
import subprocess
import sys

import yaml

from grpo_stream.common.config.access import REDIS_PASSWORD_ENV
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.redis_server import credentials
from tests.conftest import ROOT

COMPOSE = ROOT / "compose"


def header_commands(path) -> list[str]:
    """The command lines of a file's header comment (`#   command  # note`), notes left out."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#   "):
            lines.append(line[4:].split("  #")[0].strip())
    return lines


def as_bash_passes_them(words: str, home) -> list[str]:
    """The arguments bash hands a program for `words`, with $HOME at `home`."""
    proc = subprocess.run(["bash", "-c", f"printf '%s\\n' {words}"], env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30, check=True)
    return proc.stdout.splitlines()


def test_redis_compose_files_header_reaches_its_redis_with_the_password_it_made(tmp_path, monkeypatch):
    """compose/redis.yml's header: the `tokens` line writes the password, the overrides line points the services
    at it. `redis.auth.password_file=~/...` reached the process with the `~` unexpanded (bash expands a tilde inside
    a word only after the `=` of a variable assignment, and a dotted key is no variable name), and the read failed:
    `redis.auth.password_file=~/.grpo-secrets/redis.password: cannot read it (No such file or directory)`."""
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)  # it would win over the file
    commands = header_commands(COMPOSE / "redis.yml")
    make = next(c for c in commands if c.startswith("grpo-stream tokens "))
    overrides = next(c for c in commands if c.startswith("redis.url="))
    argv = as_bash_passes_them(make.removeprefix("grpo-stream "), tmp_path)
    made = subprocess.run([sys.executable, "-m", "grpo_stream", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    out = pathlib.Path(argv[argv.index("--out") + 1]).resolve()
    password = (out / "redis.password").read_text().strip()
    # the compose file mounts GRPO_SECRETS_DIR as /secrets: the directory the tokens line wrote
    up = next(c for c in commands if "docker compose -f compose/redis.yml" in c)
    assignment = up.split()[0]
    assert assignment.startswith("GRPO_SECRETS_DIR=")
    secrets_dir = subprocess.run(["bash", "-c", f"{assignment}; printf '%s' \"$GRPO_SECRETS_DIR\""],
                                 env={"HOME": str(tmp_path)}, capture_output=True, text=True, timeout=30).stdout
    assert pathlib.Path(secrets_dir).resolve() == out
    service = yaml.safe_load((COMPOSE / "redis.yml").read_text())["services"]["redis"]
    assert any(v.startswith("${GRPO_SECRETS_DIR") and v.endswith(":/secrets:ro") for v in service["volumes"])
    cfg = load_config(None, as_bash_passes_them(overrides, tmp_path))
    assert cfg.redis.url == "redis://127.0.0.1:6379/0" and service["ports"] == ["127.0.0.1:6379:6379"]
    assert credentials(cfg.redis)["password"] == password


def test_devices_compose_knows_how_many_sampler_services_the_compose_file_has():
    """`grpo-stream devices --compose` refuses a layout of more samplers than the file's services by a number it
    holds (COMPOSE_SAMPLERS): it, the sampler-<i> services and the tokens the `secrets` service makes agree."""
    from grpo_stream.plan.devices import COMPOSE_SAMPLERS  # noqa: PLC0415

    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    samplers = sorted(name for name in services if name.startswith("sampler-"))
    assert samplers == [f"sampler-{i}" for i in range(COMPOSE_SAMPLERS)]
    made = services["secrets"]["command"].split()
    assert int(made[made.index("--samplers") + 1]) == COMPOSE_SAMPLERS
    for i, name in enumerate(samplers):
        assert f"--index {i} " in services[name]["command"], name
        assert services[name]["environment"]["GRPO_STREAM_TOKEN_FILE"] == f"/secrets/{name}.token"
