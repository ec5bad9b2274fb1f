"""What the pages users read (docs/*.md, ARCHITECTURE.md, compose/README.md) and the deployment files' headers say,
against the code: every `grpo-stream` command they show parses with the command line's own parser and its config
loads; every compose service's command does, with compose/.env.example's settings (in the default lane, where
Debian's docker-compose may be missing: tests/e2e/test_compose_services.py runs them for real); every dotted config
key they name is a field (or a retired one the loader refuses with its replacement); every `file.py: Symbol` they
point to exists. README.md's commands: test_readme_commands.py."""

import argparse
import contextlib
import io
import pathlib
import re
import shlex
import tomllib

import pytest
import yaml

from grpo_stream.common.config.describe import fields
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError, RunConfig
from tests.conftest import ROOT
from grpo_stream.commands import COMMANDS
from tests.unit.test_readme_commands import alternatives

PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "ARCHITECTURE.md", ROOT / "compose" / "README.md"]
# files whose header comment shows commands (`#   grpo-stream ...`)
HEADERS = [*sorted((ROOT / "compose").glob("*.yml")), *sorted((ROOT / "compose" / "k8s").glob("*.yaml")),
           *sorted((ROOT / "compose").glob("Dockerfile.*")), *sorted((ROOT / "configs").glob("*.yaml"))]
# what placeholders in the pages stand for
VALUES = {"C": "configs/tiny_arith.yaml", "configs/PRESET": "configs/tiny_arith.yaml", "D": "{tmp}/run",
          "RUN_DIR": "{tmp}/run", "I": "0", "$i": "0", "N": "2", "R": "2", "DIR": "{tmp}/dir", "PATH": "{tmp}/p.json",
          "P": "{tmp}/p.json", "PREFIX": "trainer.", "NAME": "transport", "ID": "g", "ID1": "a", "ID2": "b"}


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def page_commands() -> list[tuple[str, str]]:
    """(where, command) for each `grpo-stream ...` the pages show: in code blocks (continuations joined, `# notes`
    left out, `a && b` split, `--command "..."` strings opened), in code spans, and in the files' header comments."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0]
                found += [(rel(page), m.group(0).strip()) for m in re.finditer(r"grpo-stream [^&;|\"]*", line)]
        for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            if span.startswith("grpo-stream "):
                found.append((rel(page), span))
    for path in HEADERS:
        header = [""]
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            text = line.lstrip("#").strip()
            if header[-1].endswith("\\"):  # a command continued on the next line
                header[-1] = header[-1][:-1] + text
            else:
                header.append(text)
        for line in header:
            line = line.split("  #")[0]
            found += [(rel(path), m.group(0).strip()) for m in re.finditer(r"grpo-stream [^&;|\"#`)]*", line)]
    return [(where, c) for where, c in dict.fromkeys(found) if c.split()[1:2] and c.split()[1] in COMMANDS]


def parsed(argv: list[str]) -> argparse.Namespace:
    """argv as `grpo-stream` reads it (cli.main: KEY=VALUE words after an option join the overrides)."""
    from grpo_stream.cli import _parser  # noqa: PLC0415 - the command line's own parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, extra = _parser().parse_known_args(argv)
    except SystemExit:
        raise AssertionError(err.getvalue().strip().splitlines()[-1]) from None
    unknown = [e for e in extra if not re.match(r"^[A-Za-z_][\w.]*=", e)]
    assert not unknown, f"unrecognized arguments: {unknown}"
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    return args


def check_command(command: str, tmp) -> None:
    form = re.sub(r"\s*\[(k=v|key=value) \.\.\.\]", "", command.removeprefix("grpo-stream "))
    for argv in alternatives(form):
        argv = [VALUES.get(t, t).format(tmp=tmp) for t in argv if t != "..."]
        argv = [re.sub(r"=([A-Z])$", lambda m: "=" + VALUES.get(m.group(1), m.group(1)), t) for t in argv]
        if len(argv) <= 1 and re.fullmatch(r"[a-z]+", "".join(argv)):
            continue  # prose naming a command
        args = parsed(argv)
        if getattr(args, "config", None) is not None or getattr(args, "overrides", None):
            load_config(args.config, list(args.overrides))


def test_the_walk_finds_the_commands():
    found = {c for _, c in page_commands()}
    assert len(found) > 40
    assert any(c.startswith("grpo-stream trainer --config configs/llama3.1_70b") for c in found)  # an xpk --command
    assert any(c.startswith("grpo-stream tokens --out $HOME/") for c in found)  # compose/redis.yml's header


@pytest.mark.parametrize("where,command", page_commands(), ids=lambda v: v[:80])
def test_every_command_the_pages_show_parses_and_its_config_loads(where, command, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    try:
        check_command(command, tmp_path)
    except (AssertionError, ConfigError) as exc:
        pytest.fail(f"{where} shows `{command}`: {exc}")


# ---- compose services --------------------------------------------------------------------------------------------

def env_example() -> dict[str, str]:
    lines = (ROOT / "compose" / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def env_example_alternatives() -> list[dict[str, str]]:
    """compose/.env.example's settings, and each commented-out block of `# KEY=VALUE` lines in it applied over them
    (the GSM8K preset's)."""
    settings, out, block = env_example(), [], {}
    for line in [*(ROOT / "compose" / ".env.example").read_text().splitlines(), ""]:
        match = re.fullmatch(r"# ([A-Z][A-Z0-9_]*)=(.*)", line)
        if match:
            block[match.group(1)] = match.group(2)
        elif block:
            out.append({**settings, **block})
            block = {}
    return [settings, {**settings, "SAMPLER_ENGINE": "vllm"}, *out]


def interpolate(text: str, env: dict[str, str]) -> str:
    """compose's `${VAR}`, `${VAR:-default}` and `${VAR:?message}`."""
    def value(m: re.Match) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        got = env.get(name, "")
        assert got or op != ":?", f"{name} must be set"
        return got if got or op != ":-" else default
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?|-)([^}]*))?\}", value, text)


def test_the_env_example_has_the_gsm8k_block():
    assert any(s["CONFIG"] != env_example()["CONFIG"] for s in env_example_alternatives())


@pytest.mark.parametrize("k", range(3), ids=["env.example", "vllm", "env.example-commented-block"])
def test_every_compose_service_command_parses_and_its_config_loads(k, monkeypatch):
    monkeypatch.chdir(ROOT)
    settings = env_example_alternatives()[k]
    services = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())["services"]
    ran = []
    for name, service in services.items():
        command = service.get("command")
        if not isinstance(command, str) or not command.startswith("grpo-stream "):
            continue
        argv = shlex.split(interpolate(command, settings))[1:]
        try:
            args = parsed(argv)
            if getattr(args, "config", None) is not None:
                load_config(args.config, list(args.overrides))
        except (AssertionError, ConfigError) as exc:
            pytest.fail(f"compose service {name} runs `{' '.join(argv)}`: {exc}")
        ran.append(name)
    assert {"secrets", "trainer", "sampler-0"} <= set(ran)


# ---- config keys and code the pages name -------------------------------------------------------------------------

def config_names() -> tuple[set[str], set[str]]:
    """Every field's dotted name and every section's; and the fields that are mappings (any key below them)."""
    docs = fields(RunConfig)
    names = {f.name for f in docs}
    names |= {".".join(n.split(".")[:k]) for n in names for k in range(1, n.count(".") + 1)}
    return names, {f.name for f in docs if f.type.startswith("dict[")}


def named_keys() -> list[tuple[str, str]]:
    """(where, key) for each code span (or `key=value` in one) that starts with a config section's name."""
    sections = set(RunConfig.model_fields)
    found = []
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            for m in re.finditer(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)(?==|\s|$)", span):
                if m.group(1).split(".")[0] in sections:
                    found.append((rel(page), m.group(1)))
    return list(dict.fromkeys(found))


RETIRED_EXAMPLES = {"trainer.stepz"}  # the pages' example of a misspelt key
# names that only look like keys: a Hugging Face tensor, W&B's run object
NOT_CONFIG = {"model.embed_tokens", "run.summary"}
FILE_TYPES = {"json", "log", "lock", "safetensors", "password", "conf", "py", "yml", "yaml", "md", "secret", "proto"}


def test_every_config_key_the_pages_name_exists_or_is_refused_with_its_replacement():
    names, mappings = config_names()
    wrong = []
    for where, key in named_keys():
        if key in names or key in RETIRED_EXAMPLES | NOT_CONFIG or key.rsplit(".", 1)[1] in FILE_TYPES:
            continue
        if any(key.startswith(m + ".") for m in mappings):
            continue
        try:
            load_config(None, [f"{key}=1"])
        except ConfigError as exc:
            if "unknown key" not in str(exc):  # a retired key: the loader names what replaced it
                continue
        wrong.append(f"{where}: {key}")
    assert not wrong, f"the pages name config keys that do not exist: {wrong}"


def source_files() -> dict[str, list[pathlib.Path]]:
    skip = {".venv", ".venv-vllm", ".git", "node_modules"}
    files = {}
    for path in ROOT.rglob("*.py"):
        if not skip & set(path.relative_to(ROOT).parts):
            files.setdefault(path.name, []).append(path)
    return files


def test_every_file_and_symbol_the_pages_point_to_exists():
    """`dir/file.py: Name` and `file.py: Name` (Name, or Class.member): a file of that path (or path tail) that
    defines or assigns the name."""
    by_name, wrong = source_files(), []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        for m in re.finditer(r"`([\w/]+\.py): ?([A-Za-z_][\w.]*)`", text):
            path, symbol = m.group(1), m.group(2).split(".")
            candidates = [p for p in by_name.get(pathlib.PurePath(path).name, [])
                          if p.as_posix().endswith("/" + path)]
            if not candidates:
                wrong.append(f"{rel(page)}: `{m.group(0)}`: no such file")
                continue
            defined = rf"(def|class) {re.escape(symbol[-1])}\b|^\s*{re.escape(symbol[-1])}\s*[:=]"
            if not any(re.search(defined, p.read_text(), re.M) for p in candidates):
                wrong.append(f"{rel(page)}: {m.group(0)}: {path} defines no {symbol[-1]}")
    assert not wrong, wrong


# ---- adding an extra to an image ---------------------------------------------------------------------------------

def test_tracking_adds_wandb_to_each_image_the_way_its_trainer_stage_installs_the_project():
    """docs/tracking.md said `.[wandb]` for every compose/Dockerfile.*: in Dockerfile.cuda that installs the project
    with pyproject's dependencies (jax 0.10.2) over the image's CUDA JAX 0.11.2 (requirements/cuda.txt). Each image's
    line must be its `jax` stage's own install of the project with the extra added, and the extra must exist."""
    from tests.unit.test_deploy_files import dockerfile_stages, stage_lines  # noqa: PLC0415

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "tracking.md").read_text())
    shown = dict(re.findall(r"`compose/(Dockerfile\.\w+)`: `([^`]+)`", text))
    assert set(shown) == {p.name for p in (ROOT / "compose").glob("Dockerfile.*")}, shown
    for dockerfile, command in shown.items():
        runs = " ".join(stage_lines(dockerfile_stages(ROOT / "compose" / dockerfile), "jax"))
        if "install-env.sh" in command:  # the script takes extras as words after its flavour
            *base, extra = command.split()
            base, added = " ".join(base), [extra]
        else:
            named = re.search(r"\.\[([\w,]+)\]", command)
            assert named, f"{dockerfile}: `{command}` installs no extra"
            added = [e for e in named.group(1).split(",") if e not in re.findall(r"\.\[([\w,]+)\]", runs)[0].split(",")]
            base = command.replace(named.group(0), ".[" + ",".join(e for e in named.group(1).split(",")
                                                                  if e not in added) + "]")
        assert base in runs, f"docs/tracking.md: {dockerfile}'s jax stage installs the project otherwise than `{base}`"
        assert added == ["wandb"] and "wandb" in extras, (dockerfile, command)


# ---- plain prompts as the pages show them -------------------------------------------------------------------------

def plain_prompt_examples() -> list[tuple[str, str]]:
    """(where, prompt) for each plain prompt a page shows as a code span: `Q: <question> A:`, after any BOS text."""
    found = []
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            if re.fullmatch(r"\S*Q: .+ A:", span.replace("\\|", "|")):
                found.append((rel(page), span.replace("\\|", "|")))
    return found


def test_every_plain_prompt_the_pages_show_is_the_one_the_code_renders(tmp_path):
    """A plain prompt starts with a BOS only where the tokenizer itself adds one (common/model/tokenizer.py:
    HFTokenizer._bos_text): SmolLM2 declares <|im_start|> but never adds it. troubleshooting.md still showed SmolLM2's
    plain prompts as `<|im_start|>Q: ... A:` and blamed that BOS for a score of 0. Each example is rendered with a
    SmolLM2-like tokenizer (its declared BOS, when the example starts with one) and must come out as shown."""
    from grpo_stream.common.model.tokenizer import HFTokenizer  # noqa: PLC0415 - transformers: this test only
    from grpo_stream.common.tasks import prompts  # noqa: PLC0415
    from tests.chatml_tokenizer import chatml_tokenizer_dir  # noqa: PLC0415

    smol = HFTokenizer(chatml_tokenizer_dir(tmp_path / "smol", pad_token="<|endoftext|>"))
    examples = plain_prompt_examples()
    assert any(where == "docs/operations.md" for where, _ in examples)  # the demo's prompt: the walk finds them
    wrong = []
    for where, shown in examples:
        bos, question = re.fullmatch(r"(\S*)Q: (.+) A:", shown).groups()
        assert bos in ("", smol._tok.bos_token), f"{where}: `{shown}`: teach this test the tokenizer whose BOS is {bos}"
        if prompts.render(question, "plain", smol) != shown:
            wrong.append(f"{where}: `{shown}`, rendered `{prompts.render(question, 'plain', smol)}`")
    assert not wrong, f"plain prompts the pages show that the code does not write: {wrong}"
