"""README.md's tables against the tree: the documentation table links every page in docs/, the configuration table
has every section of the config (and names each section's sub-sections, the registered tasks and environments), the
commands table every command and every benchmark. A failure says what to add."""

import re

from tests.unit.readme import ROOT, code_spans, section, table_rows


def names(registry) -> list[str]:
    """The names a registry holds (a dict of specs, or a registry object with `names()`)."""
    listed = getattr(registry, "names", None)
    return sorted(listed() if callable(listed) else registry)


def config_rows() -> dict[str, str]:
    """Configuration table: section name -> the rest of its row."""
    rows = {}
    for row in table_rows(section("Configuration")):
        match = re.fullmatch(r"`([a-z_]+)`", row[0])
        if match:
            rows[match.group(1)] = " ".join(row[1:])
    return rows


def test_the_documentation_table_links_every_page_in_docs():
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", section("Documentation")))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert not pages - linked, (f"README.md's documentation table (## Documentation) has no row for "
                                f"{sorted(pages - linked)}: add `| [docs/X.md](docs/X.md) | what it covers |`")
    assert not linked - pages, f"README.md's documentation table links pages that do not exist: {linked - pages}"


def test_every_relative_link_in_the_readme_resolves():
    text = (ROOT / "README.md").read_text()
    missing = [link for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text) if not (ROOT / link).exists()]
    assert not missing, f"README.md links files that do not exist: {missing}"


def test_the_configuration_table_has_every_section_and_names_its_sub_sections():
    from pydantic import BaseModel  # noqa: PLC0415

    from grpo_stream.common.config.schema import RunConfig  # noqa: PLC0415

    rows = config_rows()
    sections = RunConfig.model_fields
    missing = [name for name in sections if name not in rows]
    assert not missing, (f"README.md's configuration table (## Configuration) has no row for the config sections "
                         f"{missing}: add `| `NAME` | what it holds | [page](docs/PAGE.md) |` for each")
    stale = [name for name in rows if name not in sections]
    assert not stale, f"README.md's configuration table has rows for sections the config does not have: {stale}"
    unnamed = []
    for name, field in sections.items():
        model = field.annotation
        for sub, sub_field in model.model_fields.items():
            types = getattr(sub_field.annotation, "__args__", None) or (sub_field.annotation,)
            if any(isinstance(t, type) and issubclass(t, BaseModel) for t in types) and \
                    not re.search(rf"\b{sub}\b", rows[name]):
                unnamed.append(f"{name}.{sub}")
    assert not unnamed, (f"README.md's configuration table does not name the sub-sections {unnamed}: add "
                         "`SUB` (what it configures) to its section's row")


def test_the_task_and_environment_rows_name_every_registered_one():
    from grpo_stream.common.registry.environments import ENVIRONMENTS  # noqa: PLC0415
    from grpo_stream.common.registry.tasks import TASKS  # noqa: PLC0415

    rows = config_rows()
    for row, registry in (("task", TASKS), ("environment", ENVIRONMENTS)):
        named = set(code_spans(rows[row]))
        missing = [name for name in names(registry) if name not in named]
        assert not missing, (f"README.md's configuration table: the `{row}` row does not name the registered "
                             f"{row}s {missing}: add `NAME` for each")


def test_the_commands_table_has_every_command_and_every_benchmark():
    from grpo_stream.bench.runner import BENCHMARKS  # noqa: PLC0415
    from grpo_stream.cli import _parser  # noqa: PLC0415

    rows = [row for row in table_rows(section("Commands")) if row[0].startswith("`grpo-stream ")]
    shown = {code_spans(row[0])[0].split()[1] for row in rows}
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    missing = [name for name in commands if name not in shown]
    assert not missing, (f"README.md's commands table (## Commands) has no row for `grpo-stream {missing}`: add "
                         "`| `grpo-stream NAME ...` | what it does | [page](docs/PAGE.md) |`")
    bench = next(row for row in rows if code_spans(row[0])[0].startswith("grpo-stream bench "))
    listed = set(code_spans(bench[1]))
    missing = [name for name in BENCHMARKS if name not in listed]
    assert not missing, (f"README.md's `grpo-stream bench` row does not list the benchmarks {missing} "
                         "(bench/runner.py: BENCHMARKS): add `NAME` for each")
    stale = [name for name in listed if name not in BENCHMARKS]
    assert not stale, f"README.md's `grpo-stream bench` row lists benchmarks bench/runner.py does not have: {stale}"
