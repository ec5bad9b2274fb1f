"""No product function over 80 lines (STYLE.md; issue 42): a function that long has grown several jobs, and the
next feature lands in it. Product code: the packages under grpo_stream (common, protos, sampler_service,
trainer_service, bench and grpo_stream's own modules), generated gRPC code aside."""

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
