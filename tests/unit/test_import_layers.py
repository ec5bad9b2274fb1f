"""grpo_stream's own packages and bench/ import each other in one direction only: the command line (`cli`,
`commands`) and the GPU check sit above bench, which may use grpo_stream's libraries below it (`plan.programs`),
never a command. So no chain of imports, at the level of grpo_stream's sub-packages, its top-level modules and
bench as a whole, leads back to where it started. Imports inside functions count: they are still dependencies.
The import walk and the cycle search are test_import_floors.py's."""

from tests.unit.test_import_floors import MODULES, ROOT, _edges, explain, find_cycle, resolve

ENTRY_POINTS = {"grpo_stream.cli", "grpo_stream.commands", "grpo_stream.__main__"}


def unit_of(name: str) -> str | None:
    """The layer unit of a module (as test_import_floors names them): bench, a top-level module or sub-package of
    grpo_stream's own, or None for the shared code and the services (below both, checked there)."""
    parts = name.split(".")
    if parts[0] == "bench":
        return "bench"
    return f"grpo_stream.{parts[1]}" if parts[0] == "grpo_stream" and len(parts) > 1 else None


def test_the_walk_finds_the_units():
    units = {unit_of(name) for name in MODULES}
    assert {"bench", "grpo_stream.cli", "grpo_stream.commands", "grpo_stream.up", "grpo_stream.plan",
            "grpo_stream.gpu_check"} <= units
    assert _edges(unit_of)["grpo_stream.gpu_check"].get("bench")  # the known edge: the check reuses bench's figures


def test_no_import_cycle_between_grpo_streams_own_packages_and_bench():
    edges = _edges(unit_of)
    cycle = find_cycle(edges)
    assert not cycle, (explain(edges, cycle) + "\nbench may import grpo_stream's libraries, never a module that "
                       "imports bench: move what both need below both (a library module, or common/ if it truly "
                       "belongs there)")


def test_bench_imports_no_command_and_the_cli_reaches_bench_only_through_its_registry():
    into_commands = {u: why for u, why in _edges(unit_of)["bench"].items() if u in ENTRY_POINTS}
    assert not into_commands, f"bench imports the command line: {into_commands}"
    for name in ("grpo_stream.cli", "grpo_stream.commands"):
        module = MODULES[name]
        for node, target, in_function, _ in module.imports():
            resolved = resolve(target)
            if resolved and unit_of(resolved) == "bench":
                assert resolved == "bench.runner" and in_function, (
                    f"{module.path.relative_to(ROOT)}:{node.lineno} imports {target}: the command line imports bench "
                    "only inside the bench command, through its registry (grpo_stream.bench.runner)")
