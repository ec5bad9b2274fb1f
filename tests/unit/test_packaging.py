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
