"""Child process of test_sharding_families.py (fake devices: XLA_FLAGS is set before JAX starts).

Runs the trainer's update of every registered family's tiny model on one device and on a mesh of the fake devices
(fsdp x tp from argv, e.g. `2x2`), and prints one JSON document, per family: the gaps between the two (the
minibatch's gradients and loss, the parameters after two donated updates), whether the mesh run's parameters and
optimizer moments sit on the shardings `param_shardings` gives, and whether the update consumed (donated) its inputs.
The families take turns at LoRA on / off and packing on / off (each pair of the two covered), so one run of every
family covers both settings each way. Then the sampler's engine generates from the first family's weights on a tp
mesh of all the devices: tokens and logprobs against one device's.
"""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_stream.common.config.learning import AlgoSection, LoraSection, OptimizerSection
from grpo_stream.common.model.architectures import from_hf_config
from grpo_stream.common.model.families import FAMILIES
from grpo_stream.common.model.lora import apply_lora
from grpo_stream.common.model.policy import build_from_architecture
from grpo_stream.common.model.sharding import make_mesh, param_shardings, place
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from tests.unit.trainer_service.learning.packing_cases import layout, noisy, one_a_row, random_batch

# (LoRA, packing) in turn: every pair of the two settings among the first four families
SETTINGS = [(False, True), (True, False), (True, True), (False, False)]
# Adam's epsilon raised to its largest setting: a weight whose gradient is zero but for float rounding (Qwen2's key
# bias: a per-head constant that softmax cancels) would otherwise take a full step of the rounding's sign
OPTIMIZER = OptimizerSection(eps=1e-2)
ALGO = AlgoSection(beta=0.1, tis_cap=2.0, minibatches=2)


def tiny_model(record):
    """The record's tiny model in float32 with its matrices drawn N(0, 0.1) (Tunix starts the MLP at zero, and an
    embedding of unit scale tied to the output makes logits so sharp that float rounding is most of a gradient) and
    its vectors (norms, biases) moved by N(0, 0.1)."""
    model = build_from_architecture(from_hf_config(dict(record.tiny_hf_config)), 0, jnp.float32)
    rng = np.random.default_rng(7)
    named = {k: (rng.normal(0, 0.1, v.shape) if v.ndim >= 2 else v + rng.normal(0, 0.1, v.shape)).astype(np.float32)
             for k, v in model.to_named_numpy().items()}
    return dataclasses.replace(model, params=model.from_named_numpy(named))


def updater_of(model, mesh, lora: bool, packing: bool) -> tuple[PolicyUpdater, object]:
    """(PolicyUpdater of `model`, the model it trains): placed on `mesh` (None: the default device) and donating there,
    with rank-4 adapters (B random) when `lora`, over packed rows or one sequence a row."""
    params = jax.tree.map(jnp.copy, model.params)  # placing on a mesh may alias device 0's buffer, then donated
    params, trainable = (place(params, mesh) if mesh is not None else params), None
    if lora:
        adapted = apply_lora(model, params, LoraSection(rank=4, alpha=8.0), seed=1)
        model, trainable = adapted.adapted, adapted.trainable()
        params = jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), noisy(adapted.adapted.params, 3, 0.05),
                              adapted.adapted.params)
    rows = layout(rows=4) if packing else one_a_row(rows=4)
    updater = PolicyUpdater(model, params, ALGO, 1e-3, 1.0, 1.0, 0, rows, mesh, OPTIMIZER, donate=mesh is not None,
                            trainable=trainable)
    return updater, model


def run(model, mesh, lora: bool, packing: bool) -> dict:
    """The gradients and loss of the first minibatch, then the parameters after two updates (and the mesh checks)."""
    updater, trained = updater_of(model, mesh, lora, packing)
    batch = random_batch(0)
    grads, metrics = updater.minibatch_gradients(jax.tree.map(lambda x: x[:12], batch), None, updater.ref_params)
    inputs = jax.tree_util.tree_leaves_with_path((updater.split(updater.params)[0], updater.opt_state))
    # copies: on CPU np.asarray of a replicated array is a view of its buffer, which the update then cannot donate
    start = {k: np.array(v) for k, v in trained.named_arrays(updater.params).items()}
    updater.update(batch)
    updater.update(random_batch(1))
    out = {"grads": jax.tree.map(np.asarray, grads), "loss": float(metrics["loss"]), "start": start,
           "params": {k: np.asarray(v) for k, v in trained.named_arrays(updater.params).items()}}
    if mesh is not None:
        out["kept"] = [jax.tree_util.keystr(path) for path, x in inputs if not x.is_deleted()]  # not donated
        out["misplaced"] = misplaced(updater, trained, mesh)
    return out


def misplaced(updater: PolicyUpdater, trained, mesh) -> list[str]:
    """Parameters not on the sharding param_shardings gives (adapters: the update keeps the layout apply_lora gave
    them), and Adam moments not on their parameter's (test_sharding_layout.py checks those shardings split every
    matrix)."""
    names, leaves = trained.names(), jax.tree.leaves(updater.params)
    want = dict(zip(names, jax.tree.leaves(param_shardings(trained.params, mesh))))
    out = [n for n, x in zip(names, leaves)
           if not n.endswith(("_lora_a", "_lora_b")) and not x.sharding.is_equivalent_to(want[n], x.ndim)]
    train = jax.tree.leaves(updater.split(updater.params)[0])
    for moments in (updater.opt_state[1][0].mu, updater.opt_state[1][0].nu):
        out += [f"moment of {i}" for i, (m, p) in enumerate(zip(jax.tree.leaves(moments), train))
                if not m.sharding.is_equivalent_to(p.sharding, m.ndim)]
    return out


def gaps(ref: dict, got: dict) -> dict:
    """Relative gaps of the mesh run from the one-device run: gradients (global norm), loss, and the parameters'
    movement over the two updates (global norm of the difference over the movement's)."""
    start = ref["start"]  # the same weights in both runs
    moved = lambda run: {k: run["params"][k] - start[k] for k in start}  # noqa: E731
    delta_ref, delta_got = moved(ref), moved(got)
    diff = optax.global_norm(jax.tree.map(lambda a, b: a - b, ref["grads"], got["grads"]))
    step_diff = optax.global_norm({k: delta_ref[k] - delta_got[k] for k in start})
    return {"grads": float(diff / optax.global_norm(ref["grads"])),
            "loss": abs(ref["loss"] - got["loss"]) / max(1.0, abs(ref["loss"])),
            "params": float(step_diff / optax.global_norm(delta_ref)),
            "moved": float(optax.global_norm(delta_ref)), "kept": got["kept"], "misplaced": got["misplaced"]}


def sampler_check(model) -> dict:
    """The engine's sampled completions from `model`'s weights on a (1, all devices) mesh against one device's."""
    from grpo_stream.common.engine.continuous import ContinuousEngine  # noqa: PLC0415 - sampler side only here

    prompts = [list(np.random.default_rng(i).integers(3, model.arch.vocab_size, 4 + i)) for i in range(5)]
    mesh = make_mesh(1, len(jax.devices()), jax.devices(), "sampler.mesh.tp")
    runs = [ContinuousEngine(model, 0, [1], max_prompt_tokens=12, max_new_tokens=10, temperature=1.0, slots=8).generate(
        params, prompts, jax.random.PRNGKey(3)) for params in (model.params, place(jax.tree.map(jnp.copy,
                                                                                                  model.params), mesh))]
    return {"tokens_equal": bool(np.array_equal(runs[0].tokens, runs[1].tokens)),
            "logprob_gap": float(np.abs(runs[0].logprobs - runs[1].logprobs).max())}


def main() -> int:
    fsdp, tp = (int(x) for x in sys.argv[1].split("x"))
    families = sys.argv[2].split(",") if len(sys.argv) > 2 else [f.family for f in FAMILIES]
    mesh = make_mesh(fsdp, tp, jax.devices(), "trainer.mesh")
    report = {}
    for i, record in enumerate(f for f in FAMILIES if f.family in families):
        lora, packing = SETTINGS[i % len(SETTINGS)]
        model = tiny_model(record)
        ref, got = run(model, None, lora, packing), run(model, mesh, lora, packing)
        report[record.family] = {"lora": lora, "packing": packing, **gaps(ref, got)}
    report["sampler"] = sampler_check(tiny_model(FAMILIES[0]))
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
