"""A version checked against a vLLM worker's torch model before any of it is written (vllm_worker.py).

vLLM's in-place reload writes a layer as soon as the layer has all its tensors, so a `load_weights` that raises
half-way (a tensor of the wrong shape, a name the model lacks) leaves the layers before it on the new version, those
after it on the old one, and the rest of the model in reload state; and a parameter the version gives no tensor for
keeps its old values with no more than a log line ("Failed to load weights"). So every install is first run dry:
each layer is put back in checkpoint layout on the meta device (vLLM's own reload metadata: `restore_layer_on_meta`),
the model's `load_weights` is run over the version with every weight loader redirected to a meta copy of its
parameter (its narrowing and shape checks run, nothing is written), and the elements each parameter received are
counted (copied, as vLLM's reload counts them, or filled: a vocabulary's padding rows). A tensor the model refuses
(an unknown name, a shape or kind its loader does not take) or a parameter left short of its elements is a
`WeightsMismatch` naming it, raised before the model's tensors are touched; the layers get their own tensors back
whatever happens.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from grpo_stream.common.runtime.errors import PermanentError

REFUSED = "weight version refused before any write"  # the start of every WeightsMismatch (it crosses processes)


class WeightsMismatch(PermanentError, ValueError):
    """A version that does not fit the engine's model (a name, shape or kind; a parameter it leaves unfilled),
    refused before anything was written: the engine keeps the version it had. `detail` may be a refusal's whole
    text (one that crossed from a worker process)."""

    def __init__(self, detail: str):
        super().__init__(detail[detail.index(REFUSED):] if REFUSED in detail else f"{REFUSED}: {detail}")


FIT_HINT = ("the trainer's model must be the one the sampler's vLLM engine was built from (the same model.path, or "
            "the same model.tiny settings)")


def check_version(model: Any, named: dict[str, Any], ties: list[tuple[str, str]]) -> None:
    """Raise WeightsMismatch unless `named` (Hugging Face name -> torch tensor) fills every parameter of `model` (a
    vLLM torch model) through its `load_weights`, with `ties` (source, alias) given the source's tensor too (as
    vllm_worker.load_into_worker does). Nothing of the model is written; its tensors are back in place on return."""
    import torch  # noqa: PLC0415 - deferred: vLLM's environment only
    from vllm.model_executor.model_loader.reload.utils import (  # noqa: PLC0415 - deferred: as above
        get_tensor_load_numel)

    received: dict[int, int] = {}  # id(meta parameter) -> elements its loader wrote
    state = {"tensor": None}  # the version's tensor load_weights took last (named in a refusal)

    def version() -> Iterator[tuple[str, Any]]:
        for name, tensor in named.items():
            state["tensor"] = f"{name} (shape {list(tensor.shape)}, {tensor.dtype})"
            yield name, tensor

    with torch.no_grad(), _dry_parameters(model, received, state):
        try:
            model.load_weights(version())
            for source, alias in ties:
                if source in named:
                    state["tensor"] = f"{source} (as the tied {alias})"
                    head = model.get_parameter(alias)
                    head.weight_loader(head, named[source])
        except WeightsMismatch:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own refusal (KeyError, AssertionError, ...)
            raise WeightsMismatch(f"{state['tensor']}: the engine's model refuses it ({type(exc).__name__}: {exc}); "
                                  f"{FIT_HINT}") from None
        short = [f"{name} ({received.get(id(param), 0)} of {get_tensor_load_numel(param)} elements)"
                 for name, param in model.named_parameters(remove_duplicate=False)
                 if getattr(param, "grpo_dry", False) and received.get(id(param), 0) < get_tensor_load_numel(param)]
    if short:
        more = " and more" if len(short) > 5 else ""
        raise WeightsMismatch(f"the version leaves the engine's {', '.join(short[:5])}{more} unfilled: they would "
                              f"keep the old version's values; {FIT_HINT}")


@contextlib.contextmanager
def _dry_parameters(model: Any, received: dict[int, int], state: dict) -> Iterator[None]:
    """While the block runs, every layer of `model` holds meta copies of its parameters in checkpoint layout (vLLM's
    reload metadata), whose weight loaders run the real ones on a meta copy and add the elements they write (copied,
    or filled: a padded vocabulary's rows) to `received`; afterwards the layers have their own tensors back."""
    import torch  # noqa: PLC0415 - deferred: vLLM's environment only
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415 - deferred: as above
    from vllm.model_executor.model_loader.reload.layerwise import (  # noqa: PLC0415 - deferred: as above
        get_layerwise_info)
    from vllm.model_executor.model_loader.reload.meta import (  # noqa: PLC0415 - deferred: as above
        SKIP_LOAD_TENSORS, restore_layer_on_meta, to_meta_tensor)
    from vllm.model_executor.model_loader.weight_utils import (  # noqa: PLC0415 - deferred: as above
        default_weight_loader)

    class Written(TorchDispatchMode):
        def __init__(self, writes: set):
            super().__init__()
            self.writes, self.numel = writes, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in self.writes:
                self.numel += args[0].numel()
            return func(*args, **(kwargs or {}))

    aten = torch.ops.aten
    writes = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}

    def checking_loader(param, original):
        def load(_param, loaded, *args, **kwargs):
            if loaded.dtype.is_floating_point != param.dtype.is_floating_point:
                raise WeightsMismatch(f"{state['tensor']}: dtype {loaded.dtype} for the engine's {param.dtype}")
            with Written(writes) as counter:
                result = original(to_meta_tensor(param), loaded, *args, **kwargs)
            received[id(param)] = received.get(id(param), 0) + counter.numel
            return result
        return load

    saved = [(layer, dict(layer._parameters), dict(layer._buffers), set(layer._non_persistent_buffers_set),
              dict(layer.__dict__)) for layer in model.modules()]
    try:
        for layer in model.modules():
            restore_layer_on_meta(layer, get_layerwise_info(layer))
            for key, param in list(layer._parameters.items()):
                if param is None or key in SKIP_LOAD_TENSORS:
                    continue
                dry = to_meta_tensor(param)  # a copy of its own: vLLM's reload metadata is left as it was
                dry.weight_loader = checking_loader(dry, _original_loader(param, default_weight_loader))
                dry.grpo_dry = True
                layer._parameters[key] = dry
        yield
    finally:
        for layer, params, buffers, non_persistent, attributes in saved:
            layer._parameters.clear()
            layer._parameters.update(params)
            layer._buffers.clear()
            layer._buffers.update(buffers)
            layer._non_persistent_buffers_set.clear()
            layer._non_persistent_buffers_set.update(non_persistent)
            for key in set(layer.__dict__) - set(attributes):
                del layer.__dict__[key]
            layer.__dict__.update({k: v for k, v in attributes.items() if layer.__dict__.get(k) is not v})


def _original_loader(param: Any, default: Any) -> Any:
    """`param`'s weight loader without vLLM's reload wrappers: a past reload leaves them on its checkpoint-layout
    copy, and once that reload is done they load nothing."""
    loader = getattr(param, "weight_loader", default)
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader
