"""The RL update of one trainer step: proximal logprobs, TIS weights, iterations x minibatches.

With one iteration and one minibatch the proximal ("old") policy is the trainer's own
weights at the start of the step, taken inside the loss as stop_gradient(logprobs), so the
ratio is exactly 1 and only the truncated importance weight carries the staleness
correction. With more passes the old logprobs are computed once, before any update.

The update has one layout: the step's batch packed on the host (packing.py; one sequence a row with
trainer.packing=false), placed on the mesh once, and run by packed_update.py's programs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from grpo_stream.common.config.learning import AlgoSection, DistillSection, OptimizerSection
from grpo_stream.common.model.policy import PolicyModel
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.distill import Teacher, distill_quantiles
from grpo_stream.trainer_service.learning.loss import aggregate, distill_advantages, policy_loss, truncated_is_weights
from grpo_stream.trainer_service.learning.off_policy_health import importance_diagnostics
from grpo_stream.trainer_service.learning.packed_update import DISTILL_KL, LOG_RATIO, PackedPrograms
from grpo_stream.trainer_service.learning.packing import PackedBatch, PackingLayout, pack_batch
from grpo_stream.trainer_service.learning.train_step import (init_optimizer_state, learning_rate_schedule, make_optimizer,
                                                   uses_master_weights)


class PolicyUpdater:
    """Params, optimizer state, (only when beta > 0) a frozen reference copy of the params and (only with
    distillation) the frozen teacher."""

    def __init__(self, model: PolicyModel, params: Any, algo: AlgoSection, learning_rate: float,
                 max_grad_norm: float, temperature: float, pad_id: int, layout: PackingLayout,
                 mesh: jax.sharding.Mesh | None = None, optimizer: OptimizerSection | None = None,
                 total_steps: int = 1, donate: bool = False, trainable: tuple[bool, ...] | None = None,
                 teacher: Teacher | None = None, distill: DistillSection | None = None):
        """`params` already placed on `mesh` (if any); the optimizer state takes their shardings, and each
        batch's rows are split over the mesh's fsdp axis (data parallel). `layout` (packing.packing_layout): the rows
        each minibatch is packed into and how many a forward and backward pass takes; a minibatch's passes'
        gradients are summed before its one optimizer update. `optimizer` (trainer.optimizer; None: Adam at a
        constant rate) with its schedule over `total_steps` trainer steps. `donate`: the update step reuses the
        buffers of the parameters and optimizer state it replaces (one copy of each on the devices, not two), so
        after `update` the previous `params` are deleted: only for a caller that keeps no other reference to them
        in use (not with weights shared in-process with samplers). `trainable` (LoRA: one flag per leaf of
        `params`, flattened order; None: all): only those leaves get gradients and optimizer state; the others are
        passed through each step unchanged and never donated. `teacher` (with `distill`, its settings): the
        distillation teacher, params placed like `params` and never updated (docs/objective.md)."""
        if (teacher is None) != (distill is None or not distill.enabled):
            raise ValueError("distillation needs both the teacher model and the distill section")
        self.teacher, self.distill = teacher, distill if teacher is not None else None
        self.model, self.algo, self.temperature, self.pad_id, self.mesh = model, algo, temperature, pad_id, mesh
        self.layout = layout
        self.learning_rate = learning_rate_schedule(learning_rate, optimizer, total_steps,
                                                    algo.num_iterations * algo.minibatches)
        self.optimizer = make_optimizer(learning_rate, max_grad_norm, optimizer, total_steps,
                                        algo.num_iterations * algo.minibatches)
        self.params = params
        self._trainable, self._treedef = trainable, jax.tree.structure(params)
        if trainable is not None and len(trainable) != self._treedef.num_leaves:
            raise ValueError(f"trainable: {len(trainable)} flags for {self._treedef.num_leaves} parameters")
        train, frozen = self.split(params)
        # gradients are pinned to the parameters' shardings: left to XLA's propagation, the passes' gradient sum can
        # come out replicated on every device (the whole model's gradients per device)
        self._param_shardings = jax.tree.map(lambda x: x.sharding, train) if mesh is not None else None
        self.master = uses_master_weights(train, optimizer.state_dtype if optimizer is not None else "float32")
        init = functools.partial(init_optimizer_state, self.optimizer, master=self.master)
        abstract_state = abstract_optimizer_state(init, train, mesh)
        if is_abstract(params):  # `grpo-stream plan`: shapes, dtypes and shardings only, nothing allocated
            self.opt_state = abstract_state
            self.ref_params = params if algo.beta > 0 else None
        else:
            self.opt_state = init(train)
            # the frozen part is shared with the reference copy: it is never donated, so it stays valid
            self.ref_params = self.join(jax.tree.map(jnp.copy, train), frozen) if algo.beta > 0 else None
        # the update returns parameters and optimizer state in the layout it takes them in (step counts placed
        # replicated from the start): left to XLA, outputs come back spelt differently (P() for P(None, None)) or
        # uncommitted, and the second step compiles the whole update again
        self.state_shardings = None
        if mesh is not None:
            opt_shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
            if not is_abstract(params):
                self.opt_state = jax.device_put(self.opt_state, opt_shardings)
            self.state_shardings = (self._param_shardings, opt_shardings, None)
        self.programs = PackedPrograms(self, layout, donate)
        self.params_copy = None  # update(copy_params=True)'s copy of the parameters it left

    def split(self, params) -> tuple[Any, Any]:
        """(trained, frozen) parts of `params`: (params, None) when everything trains; with `trainable`, two tuples
        of leaves in flattened order."""
        if self._trainable is None:
            return params, None
        leaves = jax.tree.leaves(params)
        return (tuple(x for x, t in zip(leaves, self._trainable) if t),
                tuple(x for x, t in zip(leaves, self._trainable) if not t))

    def join(self, train, frozen) -> Any:
        """The params tree from the parts `split` made."""
        if frozen is None:
            return train
        train, frozen = iter(train), iter(frozen)
        return jax.tree.unflatten(self._treedef, [next(train) if t else next(frozen) for t in self._trainable])

    def take_params_copy(self) -> Any:
        """The copy `update(copy_params=True)` left, handed over once: the updater keeps no reference to it, so it
        is freed as soon as its reader (the publication) is done."""
        copy, self.params_copy = self.params_copy, None
        return copy

    def _copied(self, params) -> Any:
        """`params` with the trained part copied on its devices (the frozen part is never donated)."""
        train, frozen = self.split(params)
        return self.join(_device_copy(train), frozen)

    def objective(self, logprobs, entropy, loss_mask, behaviour, advantages, fresh, old, ref, norm, teacher=None):
        """(loss, metrics) from per-sequence [B, T] logprobs and entropies (a pass's sequences gathered into their
        completion windows): the policy loss (loss.py) and the sampler-trainer agreement on sequences generated with
        exactly these weights. `teacher`: [B, T] the distillation teacher's logprobs (None: no distillation); the
        advantages are then per token (loss.distill_advantages)."""
        algo = self.algo
        proximal = jax.lax.stop_gradient(logprobs) if old is None else old
        kl = None
        if teacher is not None:
            advantages, kl = distill_advantages(advantages, proximal, teacher, self.distill.kl_coef,
                                                self.distill.reward_weight)
        if algo.loss_algo == "gspo-token":
            # GSPO's sequence ratio is taken against the policy that drew the sequence (the sampler's, b), as in
            # the GSPO paper: its narrow clip then bounds how far the update moves from that policy, staleness
            # included, and the ratio itself is the importance weight (no TIS). Against the trainer's own o the
            # clip never saw staleness, and stale sequences were corrected only token by token (issue 44).
            base, weights = behaviour, None
        else:
            base = old
            weights = truncated_is_weights(proximal, behaviour, algo.tis_cap) if algo.tis_cap is not None else None
        loss, m = policy_loss(logprobs, base, advantages, loss_mask, loss_algo=algo.loss_algo,
                              eps_low=algo.eps_low, eps_high=algo.eps_high, agg_mode=algo.loss_agg_mode,
                              is_weights=weights, ref_logprobs=ref, beta=algo.beta,
                              kl_estimator=algo.kl_estimator, entropy=entropy, norm=norm)
        mask = loss_mask * fresh[:, None]
        diff = jnp.abs(proximal - behaviour) * mask
        m.update(lp_diff_sum=diff.sum(), lp_diff_max=diff.max(), fresh_tokens=mask.sum(), loss=loss)
        # per token, not a statistic: the host's off-policy diagnostics (off_policy_health.py) need every token's
        # o - b, which with one minibatch exists only here (o is these very logprobs)
        m[LOG_RATIO] = jax.lax.stop_gradient(proximal - behaviour) * loss_mask
        if kl is not None:  # the means here; the quantiles on the host from every token's value
            m["distill_kl"] = aggregate(kl, loss_mask, "token-mean", norm)
            m["distill_teacher_logprob"] = aggregate(teacher, loss_mask, "token-mean", norm)
            m[DISTILL_KL] = kl * loss_mask
        return loss, m

    def pin(self, grads):
        """`grads` constrained to the parameters' shardings (a no-op without a mesh)."""
        if self._param_shardings is None:
            return grads
        return jax.lax.with_sharding_constraint(grads, self._param_shardings)

    def replicated(self, x):
        """`x` replicated on the mesh (a no-op without one): per-token outputs every process can read whole."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))

    def current_learning_rate(self) -> float:
        """The rate of the next optimizer update (the schedule read at the optimizer's update count)."""
        if not callable(self.learning_rate):
            return float(self.learning_rate)
        is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
        counts = [s.count for s in jax.tree.leaves(self.opt_state, is_leaf=is_schedule) if is_schedule(s)]
        return float(self.learning_rate(int(counts[0]) if counts else 0))

    def pack(self, batch: TrainBatch) -> PackedBatch:
        """`batch` (host arrays) packed into this update's layout, in algo.minibatches minibatches: numpy only."""
        return pack_batch(batch, self.layout, self.algo.minibatches, self.pad_id)

    def minibatch_gradients(self, batch: TrainBatch, old_params=None, ref_params=None) -> tuple[Any, dict]:
        """(gradients of the trained part, statistics) of `batch` as one minibatch, against the proximal policy
        `old_params` (None: the weights trained, as in a step of one minibatch) and the KL reference `ref_params`;
        nothing updated (with a teacher, its logprobs too). What tests compare against written-out references."""
        (passes, count, norm), = self.programs.place(pack_batch(batch, self.layout, 1, self.pad_id))
        logprobs = lambda params: None if params is None else self.programs.logprobs(params, passes, count)  # noqa
        teacher = self.programs.teacher_logprobs(passes, count) if self.teacher is not None else None
        return self.programs.gradients(*self.split(self.params), passes, count, logprobs(old_params),
                                       logprobs(ref_params), teacher, norm)

    def update(self, batch: TrainBatch | PackedBatch, group_index: np.ndarray | None = None,
               copy_params: bool = False) -> dict[str, float]:
        """Run num_iterations passes of `minibatches` optimizer steps over `batch` (packed first when it is a
        TrainBatch); return averaged metrics, with the real and laid-out tokens of one pass over the batch
        (`update_tokens_real`, `update_tokens_laid_out`: what the update's forward and backward passes computed
        over). With `group_index` ([B]: each row's group) also the importance-sampling diagnostics of the batch
        (off_policy_health.importance_diagnostics) from every token's o - b at the step's start. With a teacher,
        the quantiles of the per-token KL to it at the step's start (distill.distill_quantiles). `copy_params`: also
        leave a device copy of the new parameters in `params_copy` (the trained part copied, the frozen part as it
        is), which a later donating update does not overwrite: what a publication reads while that update runs."""
        algo, programs = self.algo, self.programs
        packed = batch if isinstance(batch, PackedBatch) else self.pack(batch)
        placed = programs.place(packed)
        needs_old = algo.num_iterations > 1 or algo.minibatches > 1
        old = [programs.logprobs(self.params, p, c) for p, c, _ in placed] if needs_old else None
        ref = ([programs.logprobs(self.ref_params, p, c) for p, c, _ in placed]
               if self.ref_params is not None else None)
        teacher = [programs.teacher_logprobs(p, c) for p, c, _ in placed] if self.teacher is not None else None
        steps = []
        for iteration in range(algo.num_iterations):
            for k in range(algo.minibatches):
                train, frozen = self.split(self.params)
                train, self.opt_state, m = programs.minibatch_step(
                    train, frozen, self.opt_state, *placed[k], None if old is None else old[k],
                    None if ref is None else ref[k], None if teacher is None else teacher[k])
                self.params = self.join(train, frozen)
                ratio, kl = m.pop(LOG_RATIO), m.pop(DISTILL_KL, None)
                # o - b (and o - t) at the step's start: the first iteration's (later ones see the same old
                # logprobs again)
                first = iteration == 0
                steps.append((m, ratio if first and group_index is not None else None, kl if first else None))
        # dispatched before the wait for the metrics, so its host cost overlaps the update's compute
        self.params_copy = self._copied(self.params) if copy_params else None
        # the metrics come back once, after every optimizer update is on its way: no wait between minibatches
        steps = jax.device_get(steps)
        tokens = [mb.normalizers[0] for mb in packed.minibatches] * algo.num_iterations
        out = summarise([m for m, _, _ in steps], algo.minibatches, tokens)
        out["learning_rate"] = self.current_learning_rate()
        out["update_tokens_real"], out["update_tokens_laid_out"] = packed.real_tokens(), packed.laid_out_tokens()
        if group_index is not None:
            log_ratio = np.zeros_like(packed.loss_mask, np.float32)
            for k, (_, ratio, _) in enumerate(steps[:algo.minibatches]):
                packed.scatter(k, np.asarray(ratio), log_ratio)
            cap = algo.tis_cap if algo.loss_algo == "grpo" else None  # gspo-token weighs by its ratio, not TIS
            out.update(importance_diagnostics(log_ratio, packed.loss_mask, np.asarray(group_index), cap))
        if teacher is not None:
            kl_tokens = np.zeros_like(packed.loss_mask, np.float32)
            for k, (_, _, kl) in enumerate(steps[:algo.minibatches]):
                packed.scatter(k, np.asarray(kl), kl_tokens)
            out.update(distill_quantiles(kl_tokens, packed.loss_mask))
        return out


# the statistics loss.py computes as means over a minibatch's tokens in the loss: the update's figure is their mean over
# all its tokens (each minibatch's weighted by its tokens), as loss.py documents them; averaged per minibatch, one of
# few tokens counted as much as one of many (the step's entropy was not its tokens' mean)
TOKEN_MEANS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean", "is_weight_mean", "kl",
               "entropy", "ppo_kl", "distill_kl")


def summarise(steps: list[dict], first_iteration: int, tokens: list[float] | None = None) -> dict[str, float]:
    """The update's metrics from its optimizer steps' (host values, in order; the first `first_iteration` of them
    are the first iteration's): each statistic averaged over the steps (`_max` and `_min` taken over them; those of
    TOKEN_MEANS weighted by the steps' `tokens` when given), and the sampler-trainer agreement of the first iteration
    (later ones see the same sequences again). `tokens`: each step's tokens in the loss; a step with none took no
    optimizer update and says nothing about ratios or clipping, so it is left out of them (an update with no token at
    all reports on-policy ratios and weights, 1)."""
    sums: dict[str, float] = {}
    agreement = {"lp_diff_sum": 0.0, "lp_diff_max": 0.0, "fresh_tokens": 0.0}
    taken, keys, weight = 0, [], 0.0
    for i, step in enumerate(steps):
        m = {key: float(v) for key, v in step.items()}
        if i < first_iteration:
            agreement["lp_diff_sum"] += m["lp_diff_sum"]
            agreement["fresh_tokens"] += m["fresh_tokens"]
            agreement["lp_diff_max"] = max(agreement["lp_diff_max"], m["lp_diff_max"])
        for key in ("lp_diff_sum", "lp_diff_max", "fresh_tokens"):
            m.pop(key)
        keys = keys or list(m)
        if tokens is not None and not tokens[i]:
            continue
        taken += 1
        if tokens is not None:
            m.update({key: m[key] * float(tokens[i]) for key in TOKEN_MEANS if key in m})
            weight += float(tokens[i])
        _accumulate(sums, m)
    out = {key: v if key.endswith(("_max", "_min")) else v / (weight if key in TOKEN_MEANS and tokens is not None
                                                               else taken) for key, v in sums.items()}
    if not taken:  # nothing in the loss anywhere: the policy is its own behaviour policy, nothing was clipped
        out = {key: 1.0 if key.startswith(("ratio_", "is_weight_")) else 0.0 for key in keys}
    out["optimizer_steps"] = taken
    out["fresh_tokens"] = agreement["fresh_tokens"]
    if agreement["fresh_tokens"]:
        out["logprob_diff_mean"] = agreement["lp_diff_sum"] / agreement["fresh_tokens"]
        out["logprob_diff_max"] = agreement["lp_diff_max"]
    return out


def _accumulate(sums: dict[str, float], m: dict[str, float]) -> None:
    """Fold one optimizer step's metrics into `sums`: `_max` by max, `_min` by min, the rest summed (averaged by
    the caller)."""
    for key, v in m.items():
        if key.endswith("_max"):
            sums[key] = max(sums.get(key, -np.inf), v)
        elif key.endswith("_min"):
            sums[key] = min(sums.get(key, np.inf), v)
        else:
            sums[key] = sums.get(key, 0.0) + v


def state_report(updater: PolicyUpdater, model_parameters: int, lora=None) -> dict:
    """What `updater` holds (bytes on all devices together) and what it trains: every one of `model_parameters`, or
    the adapters of `lora` (a LoraPolicy)."""
    nbytes = lambda tree: int(sum(x.nbytes for x in jax.tree.leaves(tree)))  # noqa: E731
    teacher = updater.teacher
    return {"params_bytes": nbytes(updater.params), "optimizer_bytes": nbytes(updater.opt_state),
            "teacher_bytes": nbytes(teacher.model.params) if teacher is not None else 0,
            "teacher_parameters": teacher.num_params() if teacher is not None else 0,
            "model_parameters": model_parameters,
            "trained_parameters": lora.adapter_count() if lora is not None else model_parameters,
            "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.rank * lora.scale,
                                               "weights": len(lora.weights)}}


@jax.jit
def _device_copy(tree):
    """`tree`'s arrays copied on their devices, shardings kept (an output never aliases an undonated input)."""
    return jax.tree.map(jnp.copy, tree)


def donates_updates(transport_in_process: bool) -> bool:
    """Whether the trainer's update step donates its parameters and optimizer state: yes, unless the weight
    transport shares the published arrays with in-process samplers (weights.transport=local)."""
    return not transport_in_process


def is_abstract(tree: Any) -> bool:
    """True when `tree`'s leaves are jax.ShapeDtypeStructs (a model that was never allocated)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def abstract_optimizer_state(init, params: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """The optimizer state `init` would make for the abstract `params`, as ShapeDtypeStructs: moments (subtrees
    shaped like the params) take the params' shardings, as optimizer.init gives them on real arrays; the rest
    (step counts) is replicated. jax.eval_shape alone drops shardings."""
    shapes = jax.eval_shape(init, params)
    tree = jax.tree.structure(params)
    replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None)
    like_params = lambda x: jax.tree.structure(x) == tree  # noqa: E731

    def shard(sub):
        if like_params(sub):
            return jax.tree.map(lambda o, p: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=p.sharding), sub, params)
        return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=replicated), sub)

    return jax.tree.map(shard, shapes, is_leaf=like_params)
