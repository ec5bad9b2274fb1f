"""Everything installs under the one name grpo_stream, and the source tree itself is that package: grpo_stream/
holds a relative symlink to each top-level folder, so a fresh clone imports from its root without an install,
static tools resolve every import without running an import hook, and wheels hold real files."""

import ast
import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("common", "protos", "sampler_service", "trainer_service", "bench")


def test_grpo_stream_links_every_top_level_folder_and_pyproject_lists_every_package():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in tool, "package-dir is an import hook in editable installs; the links replace it"
    for folder in FOLDERS:
        link = ROOT / "grpo_stream" / folder
        assert link.is_symlink() and os.readlink(link) == f"../{folder}", f"grpo_stream/{folder} -> ../{folder}"
    found = {".".join(("grpo_stream", *init.parent.relative_to(ROOT / "grpo_stream").parts))
             for folder in ("", *FOLDERS) for init in (ROOT / "grpo_stream" / folder).rglob("__init__.py")}
    assert set(tool["packages"]) == found


def test_a_fresh_clone_imports_from_its_root_without_an_install(tmp_path):
    """With the editable install's finder taken out (the dependencies stay importable): `python -c` at the root
    finds grpo_stream/ there, links included."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(f)]; "
            "sys.path.insert(0, ''); import grpo_stream.common.config.schema as s, "
            "grpo_stream.trainer_service.loop as t; print(s.__file__, t.__file__)")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(path.startswith(str(ROOT)) for path in out.stdout.split())


def grpo_stream_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("grpo_stream"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("grpo_stream"))
    return names


def test_a_static_resolver_resolves_every_grpo_stream_import_in_the_tree():
    """Jedi (the resolver behind IPython, VS Code's Jedi mode and many editors) with the repository as its project
    and no installed package on its path: every grpo_stream.* module imported anywhere in the tree resolves to a
    file of this checkout."""
    import jedi  # noqa: PLC0415

    def own(parts: tuple[str, ...]) -> bool:  # not a hidden folder's, nor one read twice through grpo_stream's links
        hidden = any(part.startswith(".") for part in parts)
        return not hidden and (parts[0] != "grpo_stream" or parts[1] not in FOLDERS)

    sources = [p for p in ROOT.rglob("*.py") if own(p.relative_to(ROOT).parts)]
    modules = set().union(*(grpo_stream_imports(p) for p in sources))
    assert len(modules) > 100
    project = jedi.Project(ROOT, added_sys_path=(), smart_sys_path=False, load_unsafe_extensions=False)
    unresolved = []
    for module in sorted(modules):
        names = jedi.Script(f"import {module}", project=project).goto(1, len(f"import {module}"))
        paths = [n.module_path for n in names if n.module_path is not None]
        if not paths or not str(paths[0]).startswith(str(ROOT)):
            unresolved.append((module, paths))
    assert not unresolved


def test_the_gpu_stack_lists_every_dependency_and_no_extra_installs_another_cuda_jax():
    """The GPU stack is a pinned file (requirements/gpu-stack-cpu.txt, included by cuda.txt and vllm-gpu.txt), not a
    pyproject extra: pyproject's jax 0.10.2 cannot take jax 0.11.2's CUDA 13 plugin. So a dependency added to
    pyproject must be added there too (Tunix aside: install-env.sh installs it without its dependency list), and no
    extra may install a CUDA JAX beside the base pins (the CUDA 12 set of jax 0.10.2 never ran on a GPU)."""
    import re  # noqa: PLC0415

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements) -> set[str]:
        return {re.sub(r"[-_.]+", "-", re.split(r"[\[=<>!~; ]", r.strip(), maxsplit=1)[0].lower())
                for r in requirements if r.strip() and not r.strip().startswith(("#", "-r"))}

    stack = (ROOT / "requirements" / "gpu-stack-cpu.txt").read_text().splitlines()
    assert names(project["dependencies"]) - {"google-tunix"} <= names(line.split("#")[0] for line in stack)
    assert "google-tunix==0.1.7" in project["dependencies"]
    assert "google-tunix==0.1.7" in (ROOT / "requirements" / "install-env.sh").read_text()
    assert not [r for deps in project["optional-dependencies"].values() for r in deps if "cuda" in r]
