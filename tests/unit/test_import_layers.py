"""grpo_stream's own packages and bench/ import each other in one direction only: the command line (`cli`,
`commands`) and the GPU check sit above bench, which may use grpo_stream's libraries below it (`plan.programs`),
never a command. So no chain of imports, at the level of grpo_stream's sub-packages, its top-level modules and
bench as a whole, leads back to where it started. Imports inside functions count: they are still dependencies."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINKS = ("common", "protos", "sampler_service", "trainer_service", "bench")  # grpo_stream/'s links to the folders
ENTRY_POINTS = {"grpo_stream.cli", "grpo_stream.commands", "grpo_stream.__main__"}


def unit_of(module: str) -> str | None:
    """The layer unit of a grpo_stream module name: bench, a top-level module or sub-package of grpo_stream's own,
    or None for the shared code and the services (below both, checked elsewhere)."""
    parts = module.split(".")
    if parts[0] != "grpo_stream" or len(parts) < 2:
        return None
    if parts[1] == "bench":
        return "bench"
    return None if parts[1] in LINKS else f"grpo_stream.{parts[1]}"


def sources() -> dict[str, list[pathlib.Path]]:
    units: dict[str, list[pathlib.Path]] = {"bench": sorted((ROOT / "bench").rglob("*.py"))}
    for path in sorted((ROOT / "grpo_stream").rglob("*.py")):
        first = path.relative_to(ROOT / "grpo_stream").parts[0]
        if first not in LINKS:
            units.setdefault(f"grpo_stream.{first.removesuffix('.py')}", []).append(path)
    return units


def imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every absolute grpo_stream import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("grpo_stream"):
            found.append((node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found.extend((a.name, id(node) in top) for a in node.names if a.name.startswith("grpo_stream"))
    return found


def graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {imported unit: the files and modules that import it}."""
    edges: dict[str, dict[str, list[str]]] = {}
    for unit, paths in sources().items():
        out = edges.setdefault(unit, {})
        for path in paths:
            for module, _ in imports(path):
                target = unit_of(module)
                if target is not None and target != unit:
                    out.setdefault(target, []).append(f"{path.relative_to(ROOT)} imports {module}")
    return edges


def a_cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first, the path so far on a stack)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        path.append(unit)
        for target in sorted(edges.get(unit, {})):
            if target in path:
                return path[path.index(target):] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        done.add(path.pop())
        return None

    for unit in sorted(edges):
        if unit not in done and (cycle := visit(unit)):
            return cycle
    return None


def test_the_walk_finds_the_units():
    units = sources()
    assert {"bench", "grpo_stream.cli", "grpo_stream.commands", "grpo_stream.up", "grpo_stream.plan",
            "grpo_stream.gpu_check"} <= set(units)
    assert graph()["grpo_stream.gpu_check"].get("bench")  # the known edge: the check reuses bench's figures


def test_no_import_cycle_between_grpo_streams_own_packages_and_bench():
    edges = graph()
    cycle = a_cycle(edges)
    if cycle:
        links = [f"{a} -> {b}: {edges[a][b][0]}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle " + " -> ".join(cycle) + " (" + "; ".join(links) + "). bench may import "
                             "grpo_stream's libraries, never a module that imports bench: move what both need "
                             "below both (a library module, or common/ if it truly belongs there)")


def test_bench_imports_no_command_and_the_cli_reaches_bench_only_through_its_registry():
    edges = graph()
    into_commands = {u: why for u, why in edges["bench"].items() if u in ENTRY_POINTS}
    assert not into_commands, f"bench imports the command line: {into_commands}"
    for unit in ("grpo_stream.cli", "grpo_stream.commands"):
        for path in sources()[unit]:
            for module, at_top in imports(path):
                if unit_of(module) == "bench":
                    assert module == "grpo_stream.bench.runner" and not at_top, (
                        f"{path.relative_to(ROOT)} imports {module}: the command line imports bench only inside the "
                        "bench command, through its registry (grpo_stream.bench.runner)")
