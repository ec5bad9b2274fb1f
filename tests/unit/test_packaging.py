"""Everything installs under the one name grpo_stream: pyproject lists every package of the tree by its installed
name (a package missing there would be missing from a wheel), and no generic top-level name is installed."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pyproject_lists_every_package_of_the_tree_under_grpo_stream():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool["package-dir"]
    assert set(mapping) == {"grpo_stream", "grpo_stream.common", "grpo_stream.protos", "grpo_stream.sampler_service",
                            "grpo_stream.trainer_service", "grpo_stream.bench"}
    found = set()
    for installed, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((installed, *rel)))
    assert set(tool["packages"]) == found
    assert all(p == "grpo_stream" or p.startswith("grpo_stream.") for p in tool["packages"])


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
