"""No product function over 80 lines (STYLE.md; issue 42): a function that long has grown several jobs, and the
next feature lands in it. No product class over 400 lines counted with the product classes it derives from (issue
57): mixins that read each other's state are one object split over files, not seams. Product code: the packages
under grpo_stream (common, protos, sampler_service, trainer_service, bench and grpo_stream's own modules), generated
gRPC code aside. No folder of product code holding more than 25 modules directly (issue 57): a folder that long no
longer says which process or concern a file belongs to."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("common", "protos", "sampler_service", "trainer_service", "bench", "grpo_stream")
LIMIT = 80


def product_modules():
    for package in PACKAGES:
        folder = ROOT / package
        paths = folder.rglob("*.py")
        if package == "grpo_stream":  # its own modules and sub-packages; its links are the other packages
            paths = (p for p in paths if p.relative_to(folder).parts[0] not in PACKAGES)
        yield from (p for p in paths if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def test_no_product_function_is_over_80_lines():
    long = []
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
    assert sum(1 for _ in product_modules()) > 150  # the walk found the tree


CLASS_LIMIT = 400


def _module_name(path: pathlib.Path) -> str:
    """The installed name of a product module (grpo_stream.common.engine.continuous for common/engine/continuous.py)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "grpo_stream":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("grpo_stream", *parts))


def _classes_and_bases() -> dict[tuple[str, str], tuple[str, int, list[tuple[str, str]]]]:
    """Every product class as (module, name) -> (where, its lines, its product-code bases as (module, name)): a base
    named in its module, imported from a product module (`from grpo_stream.x import Base`), or reached through an
    imported product module (`module.Base`)."""
    parsed = {_module_name(path): (path, ast.parse(path.read_text(), str(path))) for path in product_modules()}
    found = {}
    for module, (path, tree) in parsed.items():
        names = {node.name: (module, node.name) for node in tree.body if isinstance(node, ast.ClassDef)}
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_stream"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target in parsed:  # a module imported by name: its classes are reached as module.Class
                        modules[alias.asname or alias.name] = target
                    else:
                        names[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names if a.asname and a.name in parsed})
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in names:
                    bases.append(names[base.id])
                elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and \
                        base.value.id in modules:
                    bases.append((modules[base.value.id], base.attr))
            found[(module, node.name)] = (f"{path.relative_to(ROOT)}:{node.lineno}",
                                          node.end_lineno - node.lineno + 1, bases)
    return found


def test_no_product_class_with_its_product_bases_is_over_400_lines():
    """A class and the product classes it derives from are one object: mixins that share its state are counted with
    it (STYLE.md: seams, objects owning their state, rather than mixins)."""
    classes = _classes_and_bases()

    def family(key, seen):
        if key in seen or key not in classes:
            return seen
        seen.add(key)
        for base in classes[key][2]:
            family(base, seen)
        return seen

    sizes = {key: sum(classes[k][1] for k in family(key, set())) for key in classes}
    long = sorted(f"{classes[key][0]} {key[1]} with its product bases {classes[key][2]}: {lines} lines"
                  for key, lines in sizes.items() if lines > CLASS_LIMIT)
    assert not long, "\n".join(long)
    assert ("grpo_stream.common.engine.continuous", "ContinuousEngine") in classes  # the walk found the classes
    derived = [key for key in classes if classes[key][2]]
    assert len(derived) > 10, derived  # ... and resolved product bases across modules


FOLDER_LIMIT = 25


def test_no_product_folder_holds_more_than_25_modules_directly():
    folders: dict[pathlib.Path, int] = {}
    for path in product_modules():
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(f.relative_to(ROOT)): n for f, n in folders.items() if n > FOLDER_LIMIT}
    assert not crowded, f"split these folders into sub-packages by process or concern: {crowded}"
    assert len(folders) > 20  # the walk found the tree's folders
