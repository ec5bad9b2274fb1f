"""The RL update of one trainer step: proximal logprobs, TIS weights, iterations x minibatches.

With one iteration and one minibatch the proximal ("old") policy is the trainer's own
weights at the start of the step, taken inside the loss as stop_gradient(logprobs), so the
ratio is exactly 1 and only the truncated importance weight carries the staleness
correction. With more passes the old logprobs are computed once, before any update.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from grpo_stream.common.config.learning import AlgoSection, OptimizerSection
from grpo_stream.common.model.activation_sharding import activation_sharding
from grpo_stream.common.model.policy import PolicyModel, sequence_logprobs
from grpo_stream.common.model.sharding import rows_sharding
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.loss import normalizers, policy_loss, truncated_is_weights
from grpo_stream.trainer_service.learning.off_policy_health import importance_diagnostics
from grpo_stream.trainer_service.learning.packed_update import LOG_RATIO, PackedPrograms, merge_metrics, metric_start
from grpo_stream.trainer_service.learning.packing import PackingLayout, pack_minibatch
from grpo_stream.trainer_service.learning.train_step import (apply_optimizer, init_optimizer_state,
                                                            learning_rate_schedule, make_optimizer, uses_master_weights)


class PolicyUpdater:
    """Params, optimizer state and (only when beta > 0) a frozen reference copy of the params."""

    def __init__(self, model: PolicyModel, params: Any, algo: AlgoSection, learning_rate: float,
                 max_grad_norm: float, temperature: float, pad_id: int, mesh: jax.sharding.Mesh | None = None,
                 optimizer: OptimizerSection | None = None, total_steps: int = 1, micro_batch_size: int | None = None,
                 donate: bool = False, trainable: tuple[bool, ...] | None = None,
                 packing: PackingLayout | None = None):
        """`params` already placed on `mesh` (if any); the optimizer state takes their shardings, and each
        batch's rows are split over the mesh's fsdp axis (data parallel). `optimizer` (trainer.optimizer; None:
        Adam at a constant rate) with its schedule over `total_steps` trainer steps. `micro_batch_size`
        (trainer.micro_batch_size; None: the whole minibatch in one pass): sequences per forward and backward
        pass; the gradients of a minibatch's micro-batches are summed before its one optimizer update. `donate`: the
        update step reuses the buffers of the parameters and optimizer state it replaces (one copy of each on the
        devices, not two), so after `update` the previous `params` are deleted: only for a caller that keeps no
        other reference to them in use (not with weights shared in-process with samplers). `trainable` (LoRA: one
        flag per leaf of `params`, flattened order; None: all): only those leaves get gradients and optimizer state;
        the others are passed through each step unchanged and never donated. `packing` (trainer.packing): the
        update packs each minibatch's sequences into rows of that layout (packing.py) and sums the gradients of its
        passes, `micro_batch_size` then unused; None: every sequence in its own padded row."""
        self.model, self.algo, self.temperature, self.pad_id, self.mesh = model, algo, temperature, pad_id, mesh
        self.micro_batch_size = micro_batch_size
        self.learning_rate = learning_rate_schedule(learning_rate, optimizer, total_steps,
                                                    algo.num_iterations * algo.minibatches)
        self.optimizer = make_optimizer(learning_rate, max_grad_norm, optimizer, total_steps,
                                        algo.num_iterations * algo.minibatches)
        self.params = params
        self._trainable, self._treedef = trainable, jax.tree.structure(params)
        if trainable is not None and len(trainable) != self._treedef.num_leaves:
            raise ValueError(f"trainable: {len(trainable)} flags for {self._treedef.num_leaves} parameters")
        train, frozen = self.split(params)
        # gradients are pinned to the parameters' shardings: left to XLA's propagation, the micro-batch loop's
        # gradient sum can come out replicated on every device (the whole model's gradients per device)
        self._param_shardings = jax.tree.map(lambda x: x.sharding, train) if mesh is not None else None
        self.master = uses_master_weights(train, optimizer.state_dtype if optimizer is not None else "float32")
        init = functools.partial(init_optimizer_state, self.optimizer, master=self.master)
        layout = abstract_optimizer_state(init, train, mesh)
        if is_abstract(params):  # `grpo-stream plan`: shapes, dtypes and shardings only, nothing allocated
            self.opt_state = layout
            self.ref_params = params if algo.beta > 0 else None
        else:
            self.opt_state = init(train)
            # the frozen part is shared with the reference copy: it is never donated, so it stays valid
            self.ref_params = self.join(jax.tree.map(jnp.copy, train), frozen) if algo.beta > 0 else None
        self._logprobs = jax.jit(self._logprobs_impl)
        out_shardings = None
        if mesh is not None:
            # the step returns parameters and optimizer state in the layout it takes them in (step counts placed
            # replicated from the start): left to XLA, outputs come back spelt differently (P() for P(None, None))
            # or uncommitted, and the second step compiles the whole update again
            opt_shardings = jax.tree.map(lambda x: x.sharding, layout)
            if not is_abstract(params):
                self.opt_state = jax.device_put(self.opt_state, opt_shardings)
            out_shardings = (self._param_shardings, opt_shardings, None)
        self._apply_shardings = out_shardings
        self._step = jax.jit(self._step_impl, donate_argnums=(0, 2) if donate else (), out_shardings=out_shardings)
        self.packed = PackedPrograms(self, packing, donate) if packing is not None else None

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

    def _loss(self, train, frozen, batch: TrainBatch, old, ref, norm):
        """(loss, metrics) of `batch`; with `norm` (the minibatch's denominators) the share of a micro-batch."""
        logprobs, entropy = sequence_logprobs(self.model, self.join(train, frozen), batch.tokens, batch.valid,
                                              self.temperature, self.pad_id, with_entropy=True)
        return self.objective(logprobs, entropy, batch.loss_mask, batch.behaviour_logprobs, batch.advantages,
                              batch.fresh, old, ref, norm)

    def objective(self, logprobs, entropy, loss_mask, behaviour, advantages, fresh, old, ref, norm):
        """(loss, metrics) from per-sequence [B, T] logprobs and entropies (padded rows, or a packed pass's
        sequences gathered into their completion windows): the policy loss (loss.py) and the sampler-trainer
        agreement on sequences generated with exactly these weights."""
        algo = self.algo
        proximal = jax.lax.stop_gradient(logprobs) if old is None else old
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
        return loss, m

    def _accumulated(self, train, frozen, batch: TrainBatch, old, ref, micro: int):
        """Gradients and metrics of `batch` summed over micro-batches of `micro` rows, one at a time (lax.scan:
        one compiled pass, activations of one micro-batch live at once). Micro-batch j takes rows j, j + k, ...
        (k micro-batches), so with rows sharded over the fsdp axis every micro-batch stays spread over it."""
        rows = batch.tokens.shape[0]
        k = rows // micro
        norm = normalizers(batch.loss_mask)
        split = lambda x: None if x is None else jnp.swapaxes(x.reshape(micro, k, *x.shape[1:]), 0, 1)  # noqa: E731
        parts = (jax.tree.map(split, batch), split(old), split(ref))
        grad_fn = jax.value_and_grad(lambda p, f, b, o, r: self._loss(p, f, b, o, r, norm), has_aux=True)
        shapes = jax.eval_shape(lambda: grad_fn(train, frozen, *jax.tree.map(lambda x: x[0], parts))[0][1])

        def body(carry, part):
            grads, metrics = carry
            # the weights pass through a barrier with this micro-batch, so they are gathered (FSDP) inside each pass,
            # a layer at a time: XLA would otherwise hoist every layer's all-gather out of the loop as loop-invariant
            # and keep the whole model gathered for the whole step (the 70B preset's plan: ~270 GiB per chip more)
            weights, fixed, part = jax.lax.optimization_barrier((train, frozen, part))
            (_, m), g = grad_fn(weights, fixed, *part)
            ratio = m.pop(LOG_RATIO)
            return (jax.tree.map(jnp.add, grads, self.pin(g)), merge_metrics(metrics, m)), ratio

        zeros = self.pin(jax.tree.map(jnp.zeros_like, train))
        shapes.pop(LOG_RATIO)
        (grads, metrics), ratios = jax.lax.scan(body, (zeros, metric_start(shapes)), parts)
        # micro-batch j held rows j, j + k, ...: back to row order
        metrics[LOG_RATIO] = jnp.swapaxes(ratios, 0, 1).reshape(rows, -1)
        return grads, metrics

    def pin(self, grads):
        """`grads` constrained to the parameters' shardings (a no-op without a mesh)."""
        if self._param_shardings is None:
            return grads
        return jax.lax.with_sharding_constraint(grads, self._param_shardings)

    def gradients(self, train, frozen, batch: TrainBatch, old=None, ref=None):
        """(gradients of the trained part, metrics) of one minibatch: in one pass, or summed over micro-batches."""
        grads, metrics = self._gradients(train, frozen, batch, old, ref)
        metrics.pop(LOG_RATIO)
        return grads, metrics

    def _gradients(self, train, frozen, batch: TrainBatch, old, ref):
        """`gradients`, with the minibatch's per-token o - b in its metrics (LOG_RATIO, [rows, T - 1])."""
        micro = self.micro_batch_size
        if micro is None or micro >= batch.tokens.shape[0]:
            (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(train, frozen, batch, old, ref, None)
            return self.pin(grads), metrics
        return self._accumulated(train, frozen, batch, old, ref, micro)

    def replicated(self, x):
        """`x` replicated on the mesh (a no-op without one): per-token outputs every process can read whole."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))

    def _logprobs_impl(self, params, tokens, valid):
        with activation_sharding(self.mesh):  # traced with the model's activation constraints on the mesh
            return sequence_logprobs(self.model, params, tokens, valid, self.temperature, self.pad_id)

    def _step_impl(self, train, frozen, opt_state, batch: TrainBatch, old, ref):
        """One optimizer update: returns the trained part (the frozen part is the caller's, unchanged)."""
        with activation_sharding(self.mesh):  # traced with the model's activation constraints on the mesh
            grads, metrics = self._gradients(train, frozen, batch, old, ref)
        train, opt_state = apply_optimizer(self.optimizer, grads, opt_state, train, self.master)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics[LOG_RATIO] = self.replicated(metrics[LOG_RATIO])
        return train, opt_state, metrics

    def logprobs(self, params, tokens, valid):
        """Per-token logprobs of a step's batch under `params` (old or reference policy), in passes of
        micro_batch_size rows when that is set, so they never hold more activations than an update pass."""
        micro, rows = self.micro_batch_size, tokens.shape[0]
        if micro is None or micro >= rows or rows % micro:
            return self._logprobs(params, tokens, valid)
        k = rows // micro  # pass i takes rows i, i + k, ...: spread over the fsdp axis as the micro-batches are
        parts = [self._logprobs(params, tokens[i::k], valid[i::k]) for i in range(k)]
        return jnp.stack(parts, axis=1).reshape(rows, -1)

    def current_learning_rate(self) -> float:
        """The rate of the next optimizer update (the schedule read at the optimizer's update count)."""
        if not callable(self.learning_rate):
            return float(self.learning_rate)
        is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
        counts = [s.count for s in jax.tree.leaves(self.opt_state, is_leaf=is_schedule) if is_schedule(s)]
        return float(self.learning_rate(int(counts[0]) if counts else 0))

    def update(self, batch: TrainBatch, group_index: np.ndarray | None = None) -> dict[str, float]:
        """Run num_iterations passes of `minibatches` optimizer steps over `batch`; return averaged metrics, with
        the real and laid-out tokens of one pass over the batch (`update_tokens_real`, `update_tokens_laid_out`:
        what the update's forward and backward passes computed over). With `group_index` ([B]: each row's group)
        also the importance-sampling diagnostics of the batch (off_policy_health.importance_diagnostics) from
        every token's o - b at the step's start."""
        algo = self.algo
        mask = None if group_index is None else np.asarray(jax.device_get(batch.loss_mask), np.float32)
        run, tokens, place = self._packed_runner(batch) if self.packed is not None else self._padded_runner(batch)
        log_ratio = None if mask is None else np.zeros_like(mask)
        sums: dict[str, float] = {}
        agreement = {"lp_diff_sum": 0.0, "lp_diff_max": 0.0, "fresh_tokens": 0.0}
        count = 0
        for iteration in range(algo.num_iterations):
            for k in range(algo.minibatches):
                train, frozen = self.split(self.params)
                train, self.opt_state, m = run(k, train, frozen)
                self.params = self.join(train, frozen)
                ratio = m.pop(LOG_RATIO)
                if iteration == 0 and log_ratio is not None:  # later passes see the same old logprobs again
                    place(k, np.asarray(jax.device_get(ratio)), log_ratio)
                m = {key: float(v) for key, v in jax.device_get(m).items()}
                if iteration == 0:
                    agreement["lp_diff_sum"] += m["lp_diff_sum"]
                    agreement["fresh_tokens"] += m["fresh_tokens"]
                    agreement["lp_diff_max"] = max(agreement["lp_diff_max"], m["lp_diff_max"])
                for key in ("lp_diff_sum", "lp_diff_max", "fresh_tokens"):
                    m.pop(key)
                _accumulate(sums, m)
                count += 1
        out = {key: v if key.endswith(("_max", "_min")) else v / count for key, v in sums.items()}
        out["optimizer_steps"] = count
        out["learning_rate"] = self.current_learning_rate()
        out["fresh_tokens"] = agreement["fresh_tokens"]
        if agreement["fresh_tokens"]:
            out["logprob_diff_mean"] = agreement["lp_diff_sum"] / agreement["fresh_tokens"]
            out["logprob_diff_max"] = agreement["lp_diff_max"]
        out["update_tokens_real"], out["update_tokens_laid_out"] = tokens
        if log_ratio is not None:
            cap = algo.tis_cap if algo.loss_algo == "grpo" else None  # gspo-token weighs by its ratio, not TIS
            out.update(importance_diagnostics(log_ratio, mask, np.asarray(group_index), cap))
        return out

    def _padded_runner(self, batch: TrainBatch):
        """(run(k, train, frozen) -> (train, opt_state, metrics) of minibatch k in the padded layout, (real,
        laid-out) tokens, place(k, ratio, out): minibatch k's per-token o - b into the batch's [B, T - 1] `out`)."""
        algo = self.algo
        # counted before placing: a batch placed on a mesh over several processes is not readable whole here
        tokens = (int(np.asarray(batch.valid).sum()), int(np.prod(batch.valid.shape)))
        if self.mesh is not None:
            batch = jax.device_put(batch, rows_sharding(self.mesh, batch.tokens.shape[0] // algo.minibatches))
        needs_old = algo.num_iterations > 1 or algo.minibatches > 1
        old = self.logprobs(self.params, batch.tokens, batch.valid) if needs_old else None
        ref = self.logprobs(self.ref_params, batch.tokens, batch.valid) if self.ref_params is not None else None
        size = batch.tokens.shape[0] // algo.minibatches

        def run(k: int, train, frozen):
            part = slice(k * size, (k + 1) * size)
            sub, sub_old, sub_ref = _fill_micro_batches(
                jax.tree.map(lambda x: x[part], batch), None if old is None else old[part],
                None if ref is None else ref[part], self.micro_batch_size)
            return self._step(train, frozen, self.opt_state, sub, sub_old, sub_ref)

        def place(k: int, ratio: np.ndarray, out: np.ndarray) -> None:
            out[k * size:(k + 1) * size] = ratio[:size]  # rows past `size` filled the last micro-batch

        return run, tokens, place

    def _packed_runner(self, batch: TrainBatch):
        """_padded_runner's pair for the packed layout: each minibatch packed (packing.py), its passes placed, and
        the old and reference logprobs of every pass computed before any update."""
        algo, packed = self.algo, self.packed
        host = jax.device_get(batch)
        size = host.tokens.shape[0] // algo.minibatches
        fields = (host.tokens, host.valid, host.loss_mask, host.behaviour_logprobs, host.advantages, host.fresh)
        packs = [pack_minibatch(*(np.asarray(x)[k * size:(k + 1) * size] for x in fields), packed.layout,
                                self.pad_id) for k in range(algo.minibatches)]
        passes = [packed.place(p) for p in packs]
        needs_old = algo.num_iterations > 1 or algo.minibatches > 1
        old = [packed.logprobs(self.params, x, p.count) for x, p in zip(passes, packs)] if needs_old else None
        ref = ([packed.logprobs(self.ref_params, x, p.count) for x, p in zip(passes, packs)]
               if self.ref_params is not None else None)

        def run(k: int, train, frozen):
            return packed.minibatch_step(train, frozen, self.opt_state, passes[k], packs[k].count,
                                         None if old is None else old[k], None if ref is None else ref[k],
                                         packs[k].normalizers)

        def place(k: int, ratio: np.ndarray, out: np.ndarray) -> None:
            # slot (pass, row, s) holds sequence sources[...] of minibatch k, its completion window at P - 1
            sources = packs[k].sources.reshape(ratio.shape[0], -1)
            at, (p, c) = np.nonzero(sources >= 0), (packed.layout.prompt_tokens, packed.layout.completion_tokens)
            out[k * size + sources[at], p - 1:p - 1 + c] = ratio[at]

        return run, (sum(p.real_tokens() for p in packs), sum(p.laid_out_tokens() for p in packs)), place


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
    return {"params_bytes": nbytes(updater.params), "optimizer_bytes": nbytes(updater.opt_state),
            "model_parameters": model_parameters,
            "trained_parameters": lora.adapter_count() if lora is not None else model_parameters,
            "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.rank * lora.scale,
                                               "weights": len(lora.weights)}}


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


def _fill_micro_batches(batch: TrainBatch, old, ref, micro: int | None):
    """Rows added to a minibatch whose size is not a multiple of `micro` (a step with injected groups of another
    size): copies of its first row with nothing in the loss (loss mask and freshness 0), so every micro-batch has
    the compiled shape and the sums are unchanged."""
    rows = batch.tokens.shape[0]
    if micro is None or micro >= rows or rows % micro == 0:
        return batch, old, ref
    extra = micro - rows % micro
    pad = lambda x: None if x is None else jnp.concatenate([x, jnp.repeat(x[:1], extra, axis=0)])  # noqa: E731
    padded = jax.tree.map(pad, batch)
    padded = padded.replace(loss_mask=padded.loss_mask.at[rows:].set(0.0), fresh=padded.fresh.at[rows:].set(0.0))
    return padded, pad(old), pad(ref)
