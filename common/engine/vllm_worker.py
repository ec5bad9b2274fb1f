"""What each vLLM worker process gains for grpo-stream (vLLM's `worker_extension_cls`): a method that installs
published weights from a safetensors file.

The engine calls it by name (`LLM.collective_rpc("load_grpo_weights", ...)`), so only the method's name and a file
path cross to the workers, in vLLM's own msgpack messages. Passing a Python function instead makes vLLM pickle it,
which it refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION is set: that switch would let whatever reaches the
engine's IPC sockets run code in the workers. Nothing here imports vLLM: the class is mixed into vLLM's worker.
"""

from __future__ import annotations


class WeightLoaderExtension:
    """Mixed into every vLLM worker; `self` is the worker (its `model_runner.model` is the model)."""

    def load_grpo_weights(self, path: str) -> int:
        """The Hugging Face-named tensors in the safetensors file at `path` into this worker's model in place;
        returns the number of tied output heads loaded (see vllm_engine.load_into_worker)."""
        from grpo_stream.common.engine.vllm_engine import load_into_worker  # noqa: PLC0415

        return load_into_worker(self, path=path)


EXTENSION = f"{__name__}.{WeightLoaderExtension.__name__}"
