"""What each vLLM worker process gains for grpo-stream (vLLM's `worker_extension_cls`): a method that installs
published weights from a safetensors file.

The engine calls it by name (`LLM.collective_rpc("load_grpo_weights", ...)`), so only the method's name and a file
path cross to the workers, in vLLM's own msgpack messages. Passing a Python function instead makes vLLM pickle it,
which it refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION is set: that switch would let whatever reaches the
engine's IPC sockets run code in the workers. Nothing here imports vLLM at import time: the class is mixed into
vLLM's worker, and `load_into_worker` (what the method runs, and what the engine hands its in-process worker) imports
it when called.
"""

from __future__ import annotations

import pathlib

import numpy as np

from grpo_stream.common.engine.vllm_weight_check import check_version


class WeightLoaderExtension:
    """Mixed into every vLLM worker; `self` is the worker (its `model_runner.model` is the model)."""

    def load_grpo_weights(self, path: str) -> int:
        """The Hugging Face-named tensors in the safetensors file at `path` into this worker's model in place;
        returns the number of tied output heads loaded (load_into_worker)."""
        return load_into_worker(self, path=path)


EXTENSION = f"{__name__}.{WeightLoaderExtension.__name__}"


def load_into_worker(worker, tensors: dict[str, np.ndarray] | None = None, path: str | None = None) -> int:
    """Runs in each vLLM worker: Hugging Face-named tensors (given, or read from a safetensors file) into the
    model in place, as vLLM's own `reload_weights` does (layers back to checkpoint layout, the model's
    `load_weights`, which keeps only this worker's tensor-parallel shard, then each layer's layout processing
    again), plus two steps it lacks: the version is first checked against the model, with nothing written
    (vllm_weight_check.check_version: a tensor the model refuses, or a parameter the version leaves unfilled, is a
    WeightsMismatch; a reload that failed half-way would leave the model part old, part new), and a tied output head
    (Qwen2.5 0.5B-3B, Gemma) is given the embedding's tensor too, where the plain reload would leave it on the old
    weights. Returns the number of tied heads loaded."""
    import torch  # noqa: PLC0415 - deferred: vLLM's environment only (this module is imported outside it too)
    from vllm.model_executor.model_loader.reload.layerwise import (  # noqa: PLC0415 - deferred: as above
        finalize_layerwise_reload, initialize_layerwise_reload)

    # deferred: JAX (which the checkpoint code imports) stays out of a worker's start
    from grpo_stream.common.model.hf_checkpoint import read_safetensors  # noqa: PLC0415

    def torch_of(arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name == "bfloat16":  # torch has no numpy bfloat16: the same 16 bits, reinterpreted
            return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    named = {name: torch_of(arr) for name, arr in
             (tensors if tensors is not None else dict(read_safetensors(pathlib.Path(path)))).items()}
    model = worker.model_runner.model
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    # module order puts the embedding (the name the checkpoint carries) before the head that reuses it
    ties = [(names[0], alias) for names in shared.values() if len(names) > 1 for alias in names[1:]]
    check_version(model, named, ties)
    with torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(iter(named.items()))
        for source, alias in ties:
            if source in named:
                head = model.get_parameter(alias)
                head.weight_loader(head, named[source])
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    return sum(source in named for source, _ in ties)
