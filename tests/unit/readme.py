"""README.md read as data: its sections, their tables and the commands it shows (for test_readme_tables.py and
test_readme_commands.py)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def section(title: str) -> str:
    """The text of `## title`, up to the next `## ` heading."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no section '## {title}'"
    return match.group(1)


def cells(line: str) -> list[str]:
    """A markdown table row's cells; `\\|` inside a cell is a literal bar."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def table_rows(text: str) -> list[list[str]]:
    """Every data row of the tables in `text` (header and rule lines left out)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [cells(line) for k, line in enumerate(lines)
            if not re.fullmatch(r"\|[-| ]+\|", line.strip()) and not (k + 1 < len(lines) and
                                                                     re.fullmatch(r"\|[-| ]+\|", lines[k + 1].strip()))]


def code_spans(text: str) -> list[str]:
    return [span.replace("\\|", "|") for span in re.findall(r"`([^`\n]+)`", text)]


COMMAND = re.compile(r"(\.venv/bin/)?(grpo-stream|python3? -m|bash) ")


def commands() -> list[str]:
    """Every command README.md shows: each step of its bash blocks, and each code span that is a command."""
    text = README.read_text()
    found = [step.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.splitlines() for step in line.split(" && ") if step.strip()]
    found += [span for span in code_spans(re.sub(r"```.*?```", "", text, flags=re.S)) if COMMAND.match(span)]
    return list(dict.fromkeys(found))
