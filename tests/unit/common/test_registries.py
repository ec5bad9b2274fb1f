"""One interface and one registry per link: each registered backend implements its interface, a new backend is
one module plus one registry line (nothing else dispatches on names), and the config takes its names from the
registries."""

import ast
import importlib
import pathlib

import jax
import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.common.episodes.registry import ROLLOUTS
from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.registry.base import Registry
from grpo_stream.common.registry.engines import ENGINES
from grpo_stream.common.registry.environments import ENVIRONMENTS
from grpo_stream.common.registry.tasks import TASKS
from grpo_stream.common.registry.transports import TRANSPORTS, TransportSpec
from grpo_stream.common.rollouts.buffer import RolloutBuffer
from grpo_stream.common.rollouts.registry import BUFFERS, open_buffer
from grpo_stream.common.tasks.rewards import REWARDS
from grpo_stream.common.weights.registry import weight_sink, weight_source
from grpo_stream.common.weights.transport import SinkContext, SourceContext
from grpo_stream.sampler_service.weight_sync import WeightSync
from grpo_stream.trainer_service.publication.publisher import WeightPublisher

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_every_registered_transport_and_engine_module_defines_its_entry_points():
    for name, spec in TRANSPORTS.items():
        module = importlib.import_module(spec.module)
        assert callable(module.make_sink) and callable(module.make_source), name
    for name, spec in ENGINES.items():
        assert callable(importlib.import_module(spec.module).build), name
    for name, spec in TASKS.items():
        assert callable(importlib.import_module(spec.module).build), name
    assert all(fn("#### 4", "4") in (0.0, 1.0) for fn in REWARDS.values())


def test_every_link_looks_its_names_up_in_the_one_registry_whose_error_names_field_name_and_choices():
    for registry in (ENGINES, TASKS, TRANSPORTS, ENVIRONMENTS, BUFFERS, ROLLOUTS, REWARDS):
        assert isinstance(registry, Registry)
        with pytest.raises(ValueError) as err:
            registry.lookup("no-such")
        assert str(err.value) == (f"{registry.field}: unknown {registry.kind} 'no-such'; choose one of "
                                  f"{sorted(registry)}{registry.otherwise}")
    with pytest.raises(ValueError, match=r"^sampler.engine: unknown engine 'tgi'; choose one of \['jax', 'vllm'\]$"):
        ENGINES.load("tgi", "build")
    for registry in (ENGINES, TASKS, TRANSPORTS, ENVIRONMENTS, ROLLOUTS):  # what `load` imports: in-tree modules only
        assert all(spec.module.startswith("grpo_stream.common.") for spec in registry.values()), registry.field


def test_no_module_but_the_registry_answers_an_unknown_name_itself():
    copies = [path.relative_to(ROOT).as_posix() for folder in ("common", "sampler_service", "trainer_service")
              for path in (ROOT / folder).rglob("*.py") if "choose one of {sorted(" in path.read_text()]
    assert copies == ["common/registry/base.py"]


def test_the_in_memory_buffer_has_every_method_of_the_interface():
    wanted = {n for n in dir(RolloutBuffer) if not n.startswith("_")}
    assert set(BUFFERS) == {"redis", "memory"}
    memory = open_buffer(None, "memory")
    assert wanted <= {n for n in dir(memory) if callable(getattr(memory, n))}


def test_a_new_transport_is_one_module_and_one_registry_line(monkeypatch, tiny_parts):
    _, _, _, model = tiny_parts
    with pytest.raises(ConfigError, match="weights.transport: unknown transport 'dict'"):
        load_config(None, ["weights.transport=dict"])
    monkeypatch.setitem(TRANSPORTS, "dict", TransportSpec("tests.unit.common.weights.dict_transport"))
    cfg = load_config(None, ["weights.transport=dict"])  # the config takes its names from the registry
    publisher = WeightPublisher(weight_sink("dict", SinkContext(cfg.weights)), "dict")
    mesh = make_mesh(1, 1, jax.devices(), "sampler.mesh.tp")
    sync = WeightSync(weight_source("dict", SourceContext(cfg.weights, "sampler-0", 5.0)), model, mesh, "sampler-0")
    assert sync.poll() is None  # nothing published yet
    publisher.publish_arrays(3, model.named_arrays(model.params), final=True)
    got = sync.poll()
    assert got.version == 3 and got.final
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(got.params),
                                                    jax.tree_util.tree_leaves(model.params)))


# the names a registry gives to backends, and the modules allowed to spell them out as values: the registries,
# each backend's own module, and code whose "grpc"/"local" means something else (the data plane's protocol)
_NAMES = set(TRANSPORTS) | set(ENGINES) | set(BUFFERS) | set(TASKS)
_ALLOWED = {"common/registry/transports.py", "common/registry/engines.py", "common/registry/tasks.py",
            "common/rollouts/registry.py",
            "common/weights/grpc_transport.py", "common/weights/checkpoint_transport.py",
            "common/weights/local_transport.py", "common/engine/continuous.py", "common/engine/vllm_engine.py",
            "common/weights/snapshot.py",  # the manifest's default transport field
            }


def test_no_code_outside_the_registries_dispatches_on_a_backend_name():
    found = []
    for folder in ("common", "sampler_service", "trainer_service", "grpo_stream"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in _ALLOWED or "_pb2" in rel:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                # a comparison with a backend's name (`x == "grpc"`, `x in ("jax", ...)`) is dispatch by name
                if isinstance(node, ast.Compare):
                    for side in [node.left, *node.comparators]:
                        values = [side] + (list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [])
                        for v in values:
                            if isinstance(v, ast.Constant) and v.value in _NAMES:
                                found.append(f"{rel}:{node.lineno} compares with {v.value!r}")
    assert not found, found
