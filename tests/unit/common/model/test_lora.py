"""model.lora: qwix adapters on the tiny model, their merge into plain weights, and the updater training them only."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.config.learning import AlgoSection, LoraSection, ModelSection
from grpo_stream.common.config.loading import ConfigError, load_config
from grpo_stream.common.model.lora import apply_lora, is_adapter
from grpo_stream.common.model.policy import build_model, sequence_logprobs
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.packing import one_sequence_per_row
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

VOCAB = 160


@pytest.fixture(scope="module")
def base():
    """The tiny model with every weight drawn at random: Tunix initialises the MLP's kernels at zero, where the MLP's
    adapters (B = 0 too) have no gradient at all, a saddle the demo's warm start leaves before LoRA begins."""
    model = build_model(ModelSection(), VOCAB, seed=0)
    rng = np.random.default_rng(0)
    named = {k: jnp.asarray(rng.normal(0, 0.1, v.shape).astype(np.float32)) if not np.any(v) else v
             for k, v in model.to_named_numpy().items()}
    return dataclasses.replace(model, params=model.from_named_numpy(named))


def with_random_b(lora, seed=0):
    """The adapted params with B drawn at random (B starts at zero, which would make every check trivial)."""
    rng = np.random.default_rng(seed)
    named = {k: jnp.asarray(rng.normal(0, 0.05, v.shape).astype(np.float32)) if k.endswith("_lora_b") else v
             for k, v in lora.adapted.named_arrays().items()}
    return lora.adapted.params_from_arrays(named)


def batch(rows=8, length=12, seed=0):
    rng = np.random.default_rng(seed)
    return TrainBatch(tokens=rng.integers(1, VOCAB, (rows, length)).astype(np.int32),
                      valid=np.ones((rows, length), bool), loss_mask=np.ones((rows, length - 1), np.float32),
                      behaviour_logprobs=np.full((rows, length - 1), -5.0, np.float32),
                      advantages=rng.normal(size=rows).astype(np.float32), fresh=np.zeros(rows, np.float32))


def rows(n=8, length=12):
    """The update's layout of `batch()`: a one-token prompt, the rest in the loss, each sequence alone in its row."""
    return one_sequence_per_row(1, length, n, n)


def test_adapters_start_at_the_base_and_merge_to_the_adapted_forward_pass(base):
    lora = apply_lora(base, base.params, LoraSection(rank=4, alpha=8.0), seed=1)
    assert {w.weight.split(".")[-2] for w in lora.weights} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"}
    assert len(lora.weights) == 7 * 2  # every projection of both layers; embeddings and head are never adapted
    b = batch()
    plain = sequence_logprobs(base, base.params, b.tokens, b.valid, 1.0, 0)
    # B = 0 at the start: the adapted model is the base, and so is the merge
    start = sequence_logprobs(lora.adapted, lora.adapted.params, b.tokens, b.valid, 1.0, 0)
    assert float(jnp.abs(start - plain).max()) == 0.0
    params = with_random_b(lora)
    adapted = sequence_logprobs(lora.adapted, params, b.tokens, b.valid, 1.0, 0)
    merged = sequence_logprobs(base, lora.merged(params), b.tokens, b.valid, 1.0, 0)
    assert float(jnp.abs(adapted - plain).max()) > 0.1  # the adapters matter...
    assert float(jnp.abs(adapted - merged).max()) < 1e-5  # ...and the samplers' merged weights compute the same


def test_targets_choose_the_projections_and_a_target_matching_nothing_is_refused(base):
    attention = apply_lora(base, base.params, LoraSection(rank=2, targets=".*/(q_proj|v_proj)"), seed=1)
    assert sorted({w.weight.split(".")[-2] for w in attention.weights}) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="model.lora.targets=.*matched no projection"):
        apply_lora(base, base.params, LoraSection(targets=".*/nothing_here"), seed=1)
    with pytest.raises(ConfigError, match="model.lora.targets: not a regular expression"):
        load_config(None, ["model.lora.targets=(unclosed"])
    assert load_config(None, ["model.lora.rank=8"]).model.lora.alpha == 32.0  # a dotted key creates the section


def test_the_updater_trains_the_adapters_only_with_optimizer_state_under_5_percent(base):
    lora = apply_lora(base, base.params, LoraSection(rank=4, alpha=8.0), seed=1)
    full = PolicyUpdater(base, base.params, AlgoSection(), 1e-3, 1.0, 1.0, 0, rows())
    updater = PolicyUpdater(lora.adapted, lora.adapted.params, AlgoSection(), 1e-2, 1.0, 1.0, 0, rows(),
                            trainable=lora.trainable())
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    assert nbytes(updater.opt_state) <= 0.05 * nbytes(full.opt_state)  # the demo model at rank 4: about 4.5%
    before = lora.adapted.to_named_numpy(updater.params)
    b = batch()
    first = updater.update(b)
    for _ in range(4):
        last = updater.update(b)
    after = lora.adapted.to_named_numpy(updater.params)
    for name in before:
        changed = not np.array_equal(before[name], after[name])
        # A moves once B is no longer zero (its gradient is x^T dy B^T): after five updates both have
        assert changed == is_adapter(name), name
    assert last["loss"] < first["loss"]  # it learns the batch


def test_adapters_give_the_same_gradients_with_and_without_rematerialisation(base):
    section = LoraSection(rank=4, alpha=8.0)
    b = batch()
    grads = []
    for mode in ("none", "full"):
        lora = apply_lora(base.with_remat(mode), base.params, section, seed=1)
        updater = PolicyUpdater(lora.adapted, with_random_b(lora), AlgoSection(), 1e-3, 1.0, 1.0, 0, rows(),
                                trainable=lora.trainable())
        g, _ = updater.minibatch_gradients(b)
        grads.append(g)
    norm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(grads[0]))))
    assert norm > 0 and len(jax.tree.leaves(grads[0])) == 28  # A and B of 14 weights, nothing of the base
    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])))
    assert diff <= 1e-5 * norm


def test_adapters_sit_on_their_weights_mesh_so_the_update_compiles_once(base):
    from grpo_stream.common.model.sharding import make_mesh, place

    mesh = make_mesh(1, 1, jax.devices()[:1], "trainer.mesh")
    lora = apply_lora(base, place(base.params, mesh), LoraSection(rank=4), seed=1)
    named = lora.adapted.named_arrays()
    for w in lora.weights:
        for name in (w.a, w.b):
            assert isinstance(named[name].sharding, jax.sharding.NamedSharding), name
            assert named[name].sharding.mesh == named[w.weight].sharding.mesh
    updater = PolicyUpdater(lora.adapted, lora.adapted.params, AlgoSection(), 1e-3, 1.0, 1.0, 0, rows(), mesh,
                            donate=True, trainable=lora.trainable())
    for _ in range(2):
        updater.update(batch())
    assert updater.programs._step._cache_size() == 1  # the step takes back the adapters in the layout it returns them in


@pytest.mark.parametrize("family", ["gemma2-gqa", "gemma2-mha"])
def test_the_default_targets_adapt_every_attention_projection_of_gemma(tmp_path, family):
    """Gemma with as many key/value heads as query heads keeps q, k and v in one qkv_einsum: the default targets
    must adapt it as they adapt q_einsum and kv_einsum, or attention trains no adapter at all."""
    from grpo_stream.common.model.policy import load_hf_model  # noqa: PLC0415
    from tests.unit.common.model.test_hf_checkpoint import make_hf_model  # noqa: PLC0415

    make_hf_model(tmp_path, family, 0)
    model = load_hf_model(str(tmp_path), "float32")
    attention = {n for n in model.names() if n.startswith("layers.0.attn.") and n.endswith("einsum.w")}
    lora = apply_lora(model, model.params, LoraSection(), seed=0)
    assert len(attention) == (2 if family.endswith("mha") else 3)
    assert attention <= {w.weight for w in lora.weights}, attention - {w.weight for w in lora.weights}


def test_targets_matching_nothing_are_answered_with_the_familys_own_module_paths(tmp_path):
    """Gemma names its attention projections q_einsum / kv_einsum / attn_vec_einsum: a pattern written for Llama's
    q_proj matches nothing there, and the error lists what it can match instead of another family's names."""
    from grpo_stream.common.model.policy import load_hf_model  # noqa: PLC0415
    from tests.unit.common.model.test_hf_checkpoint import make_hf_model  # noqa: PLC0415

    make_hf_model(tmp_path, "gemma2-gqa", 0)
    model = load_hf_model(str(tmp_path), "float32")
    with pytest.raises(ValueError, match="model.lora.targets=.*matched no projection of the gemma2") as err:
        apply_lora(model, model.params, LoraSection(targets=".*/(q_proj|v_proj)"), seed=0)
    assert "layers/0/attn/q_einsum" in str(err.value) and "layers/0/mlp/down_proj" in str(err.value)
    assert "q_proj" not in str(err.value).split("module paths")[1]  # never another family's names


@pytest.mark.parametrize("targets, part", [
    (".*/(q_proj|v_prj)", "v_prj"),  # a typo: q_proj alone was adapted, silently
    (".*/q_proj|.*/mlp/up_projection", ".*/mlp/up_projection"),
    # the output head's path is 'lm_head', with no '/' before it: the default's '.*/(...)' extended never matches it
    (".*/(q_proj|lm_head)", "lm_head"),
])
def test_a_part_of_the_targets_that_adapts_nothing_is_refused_naming_it(base, targets, part):
    """Each alternative of a pattern of your own must adapt something: a misspelt module name was ignored while the
    others were adapted, and the run trained fewer adapters than configured without a word."""
    with pytest.raises(ValueError, match=f"model.lora.targets=.*: its part '{re.escape(part)}' adapts nothing") as err:
        apply_lora(base, base.params, LoraSection(targets=targets), seed=1)
    assert "layers/0/attn/q_proj" in str(err.value) and "lm_head" in str(err.value)  # what it could match instead
    head = apply_lora(base, base.params, LoraSection(targets=".*/q_proj|lm_head"), seed=1)
    assert {w.weight for w in head.weights} == {"layers.0.attn.q_proj.w", "layers.1.attn.q_proj.w", "lm_head.w"}
    # the default names every family's projections: those of other families are no error
    assert len(apply_lora(base, base.params, LoraSection(), seed=1).weights) == 14
