"""The images' build context (the repository) leaves out what must never reach a builder, and nothing the
Dockerfiles COPY: without a .dockerignore the legacy builder sent the virtual environments (about 7 GB) and the
secrets folder `grpo-stream tokens` writes."""

import fnmatch

import pytest

from tests.conftest import ROOT


def ignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` (relative to the context) out, by its patterns (none of them negated)."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "a negated pattern: extend `ignored` to read it"
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]  # a folder left out leaves out what it holds
    for pattern in patterns:
        if pattern.startswith("**/"):  # any name at any depth
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            return True
    return False


@pytest.mark.parametrize("path", ["secrets/trainer.token", ".venv/bin/python", ".venv-vllm/lib", "models/x/config.json",
                                  "runs/demo/summary.json", ".git/HEAD", "compose/.env", "common/__pycache__/a.pyc"])
def test_what_must_not_reach_a_builder_is_left_out(path):
    assert ignored(path), path


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "compose").glob("Dockerfile.*")), ids=lambda p: p.name)
def test_nothing_a_dockerfile_copies_is_left_out(dockerfile):
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words and words[0] == "COPY" and not any(w.startswith("--from") for w in words):
            for source in words[1:-1]:
                assert not ignored(source.rstrip("/")), f"{dockerfile.name}: COPY {source} is in .dockerignore"
