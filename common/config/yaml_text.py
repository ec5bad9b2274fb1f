"""The config's YAML dialect: safe (no tags that build objects), YAML 1.2 numbers, no key given twice in one mapping,
and aliases that cannot expand a short file into a huge value; and the writer whose output reads back the same."""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

# the most nodes aliases may add beyond those the text writes out: a real config expands by a few hundred at most,
# while ten nested aliases of ten items each (a "billion laughs") expand to 10^10, which parses in a millisecond and
# then fills memory when the value is validated, printed (`config show`) or saved (RUN_DIR/config.yaml)
MAX_ALIAS_NODES = 100_000
MAX_INT_CHARS = 100  # the longest integer literal read (a config's largest limit is 20 digits)
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NUMBER_TAGS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"}
# YAML 1.2's numbers (with Python's `_` between digits): PyYAML's 1.1 rules read `1e-5` (no point) and `5e-1` as
# strings, which a typed field converts but a free-form one (`sampler.vllm.engine_args`, `task.verifiers.args`) would
# hand on as text, and `010` as octal 8 (`trainer.port: 050151` was port 20585), `1:30` as 90 (base 60) and
# `2024-01-01` as a date. The last two are text in YAML 1.2; a number with a leading zero is kept as written too
# (text: a number field reads `050151` as 50151, an environment variable keeps `010`)
_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0b[01][01_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$")
_FLOAT = re.compile(r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
                    r"|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


def _resolvers() -> dict[str | None, list[tuple[str, re.Pattern[str]]]]:
    """SafeLoader's implicit types (null, YAML 1.1's booleans, merge keys) with YAML 1.2's numbers and no dates."""
    table = {k: [(tag, rx) for tag, rx in v if tag not in _NUMBER_TAGS]
             for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, regexp in (("tag:yaml.org,2002:int", _INT), ("tag:yaml.org,2002:float", _FLOAT)):
        for first in "-+0123456789.":
            table.setdefault(first, []).append((tag, regexp))
    return table


class _Loader(yaml.SafeLoader):
    """The config's YAML (`_resolvers`)."""

    def construct_yaml_int(self, node: ScalarNode) -> int:
        """An integer, refused when longer than MAX_INT_CHARS: Python will not turn one of over 4300 digits into
        text or back, and the error of that, raised while reading the file or printing the config, named no field."""
        if len(node.value) > MAX_INT_CHARS:
            raise ConstructorError(None, None, f"an integer {len(node.value):,} characters long, more than "
                                   f"{MAX_INT_CHARS}; a config number is shorter (write a float, e.g. 1e300, or quote "
                                   "it as text)", node.start_mark)
        return super().construct_yaml_int(node)


class _Dumper(yaml.SafeDumper):
    """Writes a string that `_Loader`, or a YAML 1.1 reader, would read as another type (`'1e3'`, `'yes'`, `'010'`)
    quoted, so what `config show` prints and RUN_DIR/config.yaml holds reads back as the same config."""


_Loader.yaml_implicit_resolvers = _resolvers()
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Dumper.yaml_implicit_resolvers = {k: [*yaml.SafeDumper.yaml_implicit_resolvers.get(k, []), *v]
                                   for k, v in _resolvers().items()}


def _refuse_repeated_keys(node: MappingNode) -> None:
    """A key written twice in one mapping (PyYAML keeps the last silently, so an edit lower in a long section would
    quietly undo one above it). Checked on the composed nodes, before merge keys (`<<: *base`) are folded in: a key
    a mapping writes itself may override a merged one."""
    first_line: dict[tuple[str, str], int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG or not isinstance(key_node, ScalarNode):
            continue
        key = (key_node.tag, key_node.value)
        if key in first_line:
            raise ConstructorError("while constructing a mapping", node.start_mark,
                                   f"found key {key_node.value!r} a second time (first on line {first_line[key]}); "
                                   "keep one of them", key_node.start_mark)
        first_line[key] = key_node.start_mark.line + 1


def _check_nodes(root: Node) -> None:
    """Refuse a document with a key written twice in a mapping, or whose aliases expand it by more than
    MAX_ALIAS_NODES nodes, or refer to themselves."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise ConstructorError(None, None, "an alias refers to the value that contains it (a recursive "
                                   "structure); a config holds plain values", node.start_mark)
        children: list[Node] = []
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            _refuse_repeated_keys(node)
            children = [n for pair in node.value for n in pair]
        open_nodes.add(id(node))
        sizes[id(node)] = 1 + sum(size(child) for child in children)
        open_nodes.discard(id(node))
        return sizes[id(node)]

    expanded = size(root)
    if expanded - len(sizes) > MAX_ALIAS_NODES:
        raise ConstructorError(None, None, f"its aliases expand it to {expanded:,} values, more than "
                               f"{MAX_ALIAS_NODES:,} beyond the {len(sizes):,} it writes out (nested aliases that "
                               "multiply: a 'billion laughs'); write the values out or use fewer nested aliases",
                               root.start_mark)


def _unshared(value: Any) -> Any:
    """`value` with every mapping and list its own object: PyYAML builds an aliased value (`sampler_env: *env`, a
    merge key's values) once and puts that one object in each place, so a dotted override into one of the places
    (`hardware.trainer_env.B=2`) changed the others too."""
    if isinstance(value, dict):
        return {key: _unshared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unshared(item) for item in value]
    return value


def read_yaml(text: str) -> Any:
    """`text` parsed as the config's YAML: safe, YAML 1.2 numbers, no repeated keys, bounded alias expansion, no
    value shared between two places."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_nodes(root)
        return _unshared(loader.construct_document(root))  # copies at most MAX_ALIAS_NODES more than the text holds
    finally:
        loader.dispose()


def one_line(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: where (line and column, 1-based), what it was reading, the problem."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return str(exc).replace("\n", " ")
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = ", ".join(part for part in (exc.context, exc.problem) if part)
    return f"{where}{what}"


def dump_yaml(data: Any) -> str:
    """`data` as YAML text that `read_yaml` reads back equal (block style, keys in their order)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def dropped_comment(text: str) -> str | None:
    """The text after a one-value document `text` that YAML drops as a comment (`Answer with #### N`: ` #...`),
    or None; for a dotted override's value, where a person means the text whole."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    rest = text[root.end_mark.index:].strip() if root is not None else ""
    return rest if rest.startswith("#") else None
