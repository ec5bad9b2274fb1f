"""Every command README.md shows runs as written. The quick ones run (`config`, `devices`, `tokens`, the protobuf
check; a command that takes a config runs dry, with `--print-config`, which loads and validates it and starts
nothing); the others are parsed: a `grpo-stream` form against the command line's own parser, a `python -m` form
against its module's `--help` (each option and each choice it names), a script's options against the script.
Placeholders (C, D, N, ...) stand for values; optional parts are filled in, so every option shown is checked.
The runs behind the long commands have tests of their own (the demo: tests/e2e/test_demo.py; plan:
tests/e2e/test_plan.py; bench: tests/bench/)."""

import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from tests.unit.readme import README, ROOT, code_spans, commands

# the values placeholders stand for; {tmp} is the test's own directory
VALUES = {"C": "configs/tiny_arith.yaml", "D": "{tmp}/run", "P": "{tmp}/out.json", "I": "0", "N": "2",
          "DIR": "{tmp}/dir", "FILE.jsonl": "{tmp}/prompts.jsonl", "H:P": "127.0.0.1:1", "U": "redis://127.0.0.1:1",
          "ID": "g", "PREFIX": "trainer.", "NAME": "transport", "OUT": "{tmp}/out", "F": "{tmp}/f.json",
          "W": "{tmp}/warmstart"}
RUN = {"config", "devices", "tokens"}  # quick enough to run as written; the others that take a config run dry
DRY = {"grpo_stream.protos.generate": ["--check"]}  # python -m forms that run as written: they only check


def alternatives(form: str) -> list[list[str]]:
    """The argument lists a synopsis stands for: optional parts filled in ([k=v ...] left out), the first of
    `(a | b)`, and one list per alternative of `x|y`."""
    form = re.sub(r"\s*\[k=v \.\.\.\]", "", form)
    form = re.sub(r"\(([^()|]+?)\s*\|[^()]*\)", r"\1", form)
    tokens = shlex.split(form.replace("[", " ").replace("]", " "))
    choices = [t.split("|") if "|" in t else [t] for t in tokens]
    width = max(len(c) for c in choices)
    return [[c[min(k, len(c) - 1)] for c in choices] for k in range(width)]


def filled(tokens: list[str], tmp) -> list[str]:
    return [VALUES.get(t, t).format(tmp=tmp) for t in tokens]


def options(tokens: list[str]) -> list[str]:
    return [t for t in tokens if t.startswith("--")]


def check_grpo_stream(argv: list[str], tmp, capsys) -> None:
    from grpo_stream.cli import _parser, main  # noqa: PLC0415

    try:
        args = _parser().parse_args(argv)
    except SystemExit:
        if len(argv) <= 2 and all(re.fullmatch(r"[a-z]+", t) for t in argv):  # prose naming a command, not a form
            capsys.readouterr()
            return
        pytest.fail(f"`grpo-stream {' '.join(argv)}` does not parse: {capsys.readouterr().err}")
    if argv[0] in RUN:
        code = main(argv)
    elif getattr(args, "config", None) is not None:
        code = main([*argv, "--print-config"])
    else:
        return
    out = capsys.readouterr()
    assert code == 0, f"`grpo-stream {' '.join(argv)}` exited {code}: {out.err[-2000:]}"


def check_module(module: str, argv: list[str], bare: list[str]) -> None:
    """`argv`: the form with its optional parts filled in; `bare`: without them."""
    if module in DRY:
        proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"python -m {module} {' '.join(argv)}: {proc.stderr[-2000:]}"
        return
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"python -m {module} --help: {proc.stderr[-2000:]}"
    usage = proc.stdout
    unknown = [t for t in argv if t.startswith("--") and t not in usage]
    positional = [t for t in argv if not t.startswith("-") and t not in VALUES.values() and "{" not in t]
    choices = [t for t in positional[:1] if not re.search(rf"[{{,]{re.escape(t)}[,}}]", usage)]
    assert not unknown and not choices, (f"README.md shows `python -m {module} {' '.join(argv)}`; its usage has no "
                                         f"{unknown + choices}:\n{usage}")
    synopsis = re.sub(r"\[[^\[\]]*\]", "", usage.split("\n\n")[0])  # what is left of the usage line is required
    required = [o for o in re.findall(r"(?<![\w-])--[\w-]+", synopsis) if o not in bare]
    assert not required, f"README.md shows `python -m {module} {' '.join(bare)}` without its required {required}"


def check_script(path: str, argv: list[str]) -> None:
    script = ROOT / path
    assert script.is_file(), f"README.md runs {path}, which does not exist"
    text = script.read_text()
    words = [t for t in argv if t not in VALUES and not t.startswith(".")]  # options and modes, not paths
    unknown = [t for t in words if t not in text]
    assert not unknown, f"README.md runs `bash {path} {' '.join(argv)}`; the script never mentions {unknown}"


def check_install(argv: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    target = argv[-1]
    assert target.startswith("."), argv
    named = re.findall(r"\[(.*)\]", target)
    missing = [e for e in (named[0].split(",") if named else []) if e not in extras]
    assert not missing, f"README.md installs extras pyproject.toml does not define: {missing}"


def check(command: str, tmp, capsys) -> None:
    program, _, rest = command.partition(" ")
    program = program.removeprefix(".venv/bin/")
    bare = re.sub(r"\[[^\[\]]*\]", "", rest).split()
    for argv in alternatives(rest):
        if program == "grpo-stream":
            check_grpo_stream(filled(argv, tmp), tmp, capsys)
        elif program in ("python", "python3") and argv[:1] == ["-m"]:
            if argv[1] in ("venv", "pytest"):  # makes the environment; runs the tests
                continue
            check_module(argv[1], filled(argv[2:], tmp), bare)
        elif program == "bash":
            check_script(argv[0], argv[1:])
        elif program == "pip" and argv[0] == "install":
            check_install(argv)
        else:
            pytest.fail(f"README.md shows `{command}`: this test does not know how to check it; teach it")


def test_the_walk_finds_the_commands():
    found = commands()
    assert len(found) > 25
    assert ".venv/bin/pip install -q -e ." in found  # the quick start installs only the package (no test extras)


@pytest.mark.parametrize("command", commands())
def test_every_command_in_the_readme_runs_as_written(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    check(command, tmp_path, capsys)


def parser_options() -> dict[str, set[str]]:
    """Each command's (and each `config` action's) option strings, and `k=v` where it takes dotted overrides (as
    positionals, or after an option: cli.main), from the command line's own parser."""
    import argparse  # noqa: PLC0415 - this test only

    from grpo_stream.cli import _parser  # noqa: PLC0415

    found: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        actions = parser._actions  # noqa: SLF001 - argparse has no public walk of a parser's arguments
        if name:
            found[name] = {o for a in actions for o in a.option_strings} | (
                {"k=v"} if any(a.dest == "overrides" for a in actions) or parser.get_default("overrides") is not None
                else set())
        for action in actions:
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}".strip())
    walk(_parser(), "")
    return found


def test_the_options_every_command_with_a_config_takes_are_what_the_readme_says():
    """README.md's "Every command that takes a config accepts ..." said `-v` too, which the prompt clients (`submit`,
    `status`, `results`, `cancel`) refuse. Each option that sentence names must parse for every command with
    `--config`, but for the commands it names as exceptions, each of which must indeed lack one of them."""
    sentence = re.search(r"Every command that takes a config accepts (.*?);", README.read_text(), re.S).group(1)
    spans = code_spans(sentence)
    wanted = {"k=v" if "=" in s else s.split()[0] for s in spans if s.startswith("-") or "=" in s}
    assert {"--config", "--print-config", "k=v"} <= wanted, sentence
    options = parser_options()
    excepted = {s for s in spans if s in options}
    with_config = [name for name, opts in options.items() if "--config" in opts]
    assert len(with_config) > 10 and excepted <= set(with_config), (with_config, excepted)
    missing = {name: sorted(wanted - options[name]) for name in with_config if wanted - options[name]}
    assert set(missing) == excepted, f"README.md: {sentence!r}; commands with a config that lack some: {missing}"
