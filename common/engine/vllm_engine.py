"""The vLLM sampling engine (sampler.engine: vllm): the JAX engine's contract on vLLM.

Same contract as `grpo_stream.common.engine.continuous.ContinuousEngine`: `generate(params, prompts, rng,
greedy)` returns a `Generation` whose logprobs are the policy's, i.e. what
the trainer recomputes with `grpo_stream.common.model.policy.token_logprobs`: softmax(logits / T)
with the pad token excluded. vLLM gives that when it is asked for
`processed_logprobs` (logprobs after logits processors and temperature) and
the pad token carries vLLM's strongest logit bias (-100: its probability is
scaled by e^-100, far below the 1e-3 the tests hold the two engines to).
No top-k / top-p / min-p, so sampling follows that distribution exactly.
A greedy request's logprobs are vLLM's at temperature 1 (it sets a greedy
row's temperature to 1), not the policy's: they reach only the endpoint's
temperature-0 answers and greedy evaluations, never training. (A logits
processor could rescale them, but vLLM's model runner V2, the GPU default,
takes another processor interface than the CPU build's, and TPU runs none.)
A request stops at the tokenizer's stop tokens only (`stop_token_ids`, with
`ignore_eos`: vLLM would also stop at the EOS of the model directory's
generation_config.json or config.json, reported as cut at the budget), as
the JAX engine does.

Serving (`serve(params, source)`, the contract of common/engine/base.py that
multi-turn episodes run on; `generate` is a serve of a fixed request set):
the engine is driven a step at a time (`LLMEngine.add_request` and `step`,
one token per live request), and before every step the requests ready then
enter it (vLLM queues what passes sampler.vllm.max_num_seqs; with in-flight
updates they wait here instead, to take the salt of the version they start
under). A request is a token-id
prompt (`TokensPrompt`), never text: an episode's later turn is the whole
conversation so far, ids as sampled plus the observation's, and with prefix
caching on (sampler.vllm.prefix_caching) it reads the blocks of the earlier
turns still cached instead of prefilling them (`cached_prompt_tokens`). Its
prompt may pass generation.max_prompt_tokens: max_model_len holds
max_prompt_tokens + max_new_tokens. Each request samples with a seed of its
own key (vLLM keeps a generator per seeded request): a request set served
again samples the same tokens.

Weights: the engine starts with random ("dummy") weights, which costs no
checkpoint read, and takes every weight from the trainer: `generate` (or
`serve`) with a params object it has not seen installs it first (between batches, as the
JAX engine's re-layout), so the sampler's version rules apply unchanged. The
policy's parameter names are mapped to Hugging Face names
(`grpo_stream.common.model.hf_checkpoint.to_hf_names`), which is what every vLLM model's
`load_weights` takes (it fuses q/k/v and gate/up itself); each worker loads
them in place with `load_into_worker` (vllm_worker.py). Two ways to reach the workers:
  iterator  the tensors, in this process (the engine core runs in this
            process: VLLM_ENABLE_V1_MULTIPROCESSING=0);
  files     one safetensors file in `stage_dir`; every worker reads it
            (tensor_parallel_size > 1: workers are other processes, and a
            path is all that crosses to them: the workers carry a loading
            method of ours (vllm_worker.py, vLLM's worker_extension_cls),
            called by name, so vLLM never pickles code to them).
After an install the prefix cache is reset: a cached prompt's keys and
values were computed with the old weights. Every request also carries the
installed version's `cache_salt` (vLLM keys cached blocks by it), so no
request can reuse another version's KV even where a reset cannot run.

On TPU (tpu-inference) the model is an nnx State of JAX arrays, not a torch
module: versions are written into it in place by `vllm_tpu.VllmTpuWeightWriter`
(the engine core in this process).

In-flight updates (sampler.weight_updates: in_flight): `generate` or `serve`
with `refresh=f` calls f() every `steps_between_updates` steps (and while
every request of a serve waits on its source: then a new version goes in
without a pause); on a new (params, version) between steps it pauses
the scheduler keeping every request (`sleep(level=0, mode="keep")`), writes the
weights in place (the KV cache stays: earlier tokens keep the keys and values
older weights computed, as the JAX engine and PipelineRL do), and resumes
(`wake_up(["scheduling"])`). A token returned by a step after the write was
sampled from the new weights' logits, so `Generation.versions` records it as
the new version; requests admitted afterwards carry the new cache salt.
Asynchronous scheduling is turned off for this mode: with it a step's batch
can be launched before the previous step's tokens are returned, and a token
could be counted under the wrong version.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable

import numpy as np

from grpo_stream.common.config.serving import engine_context
from grpo_stream.common.engine.side_requests import SideQueue, serve_sharing
from grpo_stream.common.engine.base import Generation, RequestSource, check_served, generate_by_serving, take_weights
from grpo_stream.common.engine.vllm_requests import CONTEXT_FIELD, Live, check_ended, drop_withdrawn, seed_of
from grpo_stream.common.engine.vllm_weight_check import REFUSED, WeightsMismatch
from grpo_stream.common.engine.vllm_args import accepted_args, check_known, llm_args, start_failure
from grpo_stream.common.engine.vllm_worker import load_into_worker
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.common.model.hf_checkpoint import resolve_model_dir, to_hf_names, write_hf_config, write_safetensors

log = logging.getLogger(__name__)
PAD_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]
MAX_RECORDED = 1 << 16  # requests of one serve whose prefix-cache hits are kept (cached_prompt_tokens)
# vLLM raises a temperature below this to it (SamplingParams, with a warning): its logprobs would then be those of
# softmax(logits / 0.01), not of the temperature the trainer recomputes them at
VLLM_MIN_TEMPERATURE = 0.01


class VllmEngine:
    """Generates completions with vLLM; installs the trainer's weights when `generate` gets new params."""

    def __init__(self, model_dir: str | pathlib.Path, model, pad_id: int, eos_ids: list[int], max_prompt_tokens: int,
                 max_new_tokens: int, temperature: float, settings, dtype: str = "float32", seed: int = 0,
                 in_flight: bool = False, context_tokens: int | None = None):
        """`model_dir`: a Hugging Face directory whose config.json vLLM builds the model from (its weights are not
        read); `model`: the policy model (`grpo_stream.common.model.policy.PolicyModel`, abstract is enough) whose
        params `generate` gets; `settings`: the sampler.vllm config section; `in_flight`: weights may change
        mid-generation (sampler.weight_updates=in_flight); `context_tokens`: max_model_len when more than
        max_prompt_tokens + max_new_tokens (the OpenAI endpoint's longer context)."""
        if temperature < VLLM_MIN_TEMPERATURE:
            raise PermanentError(f"generation.temperature={temperature} is below vLLM's smallest sampling temperature "
                                 f"{VLLM_MIN_TEMPERATURE}, to which vLLM would raise it: the sampler's logprobs would "
                                 "not be the trainer's. Set generation.temperature >= 0.01, or sampler.engine=jax")
        self.model, self.pad_id, self.eos_ids = model, pad_id, list(eos_ids)
        self.context_capacity = max(max_prompt_tokens + max_new_tokens, context_tokens or 0)
        self.side: SideQueue | None = None  # an endpoint's queue whose requests join every serve (side_requests.py)
        self.max_prompt_tokens, self.max_new_tokens, self.temperature = max_prompt_tokens, max_new_tokens, temperature
        self.settings = settings
        mode = settings.weight_install
        self.install_mode = mode if mode != "auto" else ("iterator" if settings.tensor_parallel_size == 1 else "files")
        if self.install_mode == "iterator":
            # the engine core in this process: tensors reach the model without serialization
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import LLM  # noqa: PLC0415 - deferred: vLLM lives in its own environment
        except ImportError as exc:
            raise RuntimeError("sampler.engine=vllm: vLLM is not installed in this environment; install it with "
                               "`bash requirements/install-vllm-env.sh DIR cpu|gpu` and run the sampler from "
                               f"there ({exc})") from None
        from vllm.platforms import current_platform  # noqa: PLC0415 - deferred: as above

        if current_platform.is_tpu():
            # tpu-inference's runner holds the model as JAX arrays; they are written in place (vllm_tpu.py), which
            # needs the engine core in this process (its mesh spans the host's chips from here, any tp)
            self.install_mode = "tpu_state"
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if in_flight and self.install_mode == "files":
            # the engine core then runs in a process of its own and keeps stepping while a version installs: tokens
            # sampled under the old weights would come back after it, labelled with the new version
            raise PermanentError("sampler.weight_updates=in_flight needs vLLM's engine core in the sampler's process: "
                                 "sampler.vllm.weight_install=iterator (tensor_parallel_size 1) on GPU or CPU; with "
                                 "tensor_parallel_size > 1 there use sampler.weight_updates=drain")
        # this engine's own directory, also inside a stage_dir several samplers of a host share (/dev/shm): a shared
        # v<n> path would have each load the other's version, or find it deleted
        if self.install_mode == "files" and settings.stage_dir:
            pathlib.Path(settings.stage_dir).mkdir(parents=True, exist_ok=True)
        self._stage_root = (pathlib.Path(tempfile.mkdtemp(prefix="grpo-vllm-", dir=settings.stage_dir))
                            if self.install_mode == "files" else None)
        self.owned_dir: pathlib.Path | None = None  # a model directory `close` removes (the tiny model's, `build`)
        args = llm_args(model_dir, settings, current_platform, dtype, seed, in_flight, self.install_mode,
                        self.context_capacity)
        started = time.monotonic()
        try:
            check_known(settings.engine_args, accepted_args(LLM))
            self.llm = LLM(**args)
        except BaseException as exc:  # a failed start is retried by a restart: no directory left per try
            self.close()
            if isinstance(exc, Exception) and not isinstance(exc, PermanentError):
                raise start_failure(exc, args, settings.engine_args) from exc
            raise
        log.info("vLLM engine up in %.1fs (%s, weights installed by %s)", time.monotonic() - started, model_dir,
                 self.install_mode)
        self._installed: Any = None
        self.broken: str | None = None  # why the engine serves nothing more (an install failed part-way)
        self.install_seconds: list[float] = []
        self.tied_heads_loaded = 0  # output heads tied to the embedding, given its new tensor at the last install
        self._epoch = uuid.uuid4().hex[:8]  # this engine's installs: salts never repeat across engine restarts
        self._requests = 0  # request ids of the in-flight path
        self.pauses = 0  # in-flight weight writes (scheduler paused with its requests kept)
        self.cached_prompt_tokens: list[int] = []  # per request of the last serve: prompt tokens the prefix cache gave
        self._tpu_writer = None
        if self.install_mode == "tpu_state":
            # deferred: tpu-inference's side, on TPU only
            from grpo_stream.common.engine.vllm_tpu import VllmTpuWeightWriter  # noqa: PLC0415

            self._tpu_writer = VllmTpuWeightWriter(self.llm, model.arch.family, list(model.names()))

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of requests under the installed version (one per install)."""
        return f"{self._epoch}:{len(self.install_seconds)}"

    def install(self, params: Any, keep_requests: bool = False) -> None:
        """Put `params` into the running engine (whole: the next batch uses only these weights; see `_write`).
        `keep_requests`: live requests go on with their KV cache (the scheduler is paused around the call)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        started = time.monotonic()
        if self._tpu_writer is not None:
            named, version = self.model.named_arrays(params), len(self.install_seconds) + 1
            self._write(lambda: self._tpu_writer.install(named, version, self._epoch, keep_kv=keep_requests))
        else:
            self._load_torch_weights(params)
        self._installed = params
        self.install_seconds.append(time.monotonic() - started)
        log.info("vLLM engine: weights installed in %.2fs (%s%s)", self.install_seconds[-1], self.install_mode,
                 ", in flight" if keep_requests else "")

    def _write(self, write: Callable[[], Any]) -> Any:
        """`write()` (a version into the model): a refusal before any write (WeightsMismatch, vllm_weight_check.py)
        leaves it as it was; any other failure leaves it part old, part new: the engine serves no more (`broken`)."""
        try:
            return write()
        except WeightsMismatch:
            raise
        except BaseException as exc:
            if REFUSED in str(exc):  # a worker process's refusal (weight_install=files) crosses as its text
                raise WeightsMismatch(str(exc)) from None
            self._installed = None
            self.broken = (f"a weight install failed part-way ({type(exc).__name__}: {exc}): the vLLM engine's model "
                           "mixes two versions and serves nothing more; the sampler must restart (a new engine)")
            raise

    def _load_torch_weights(self, params: Any) -> None:
        """GPU and CPU: the Hugging Face-named tensors into every worker's torch model, then the prefix cache reset
        (refused while requests hold blocks: the new version's salt covers that)."""
        named = to_hf_names(self.model.arch, self.model.to_named_numpy(params))
        if self.install_mode == "iterator":
            loaded = self._write(lambda: self.llm.collective_rpc(load_into_worker, kwargs={"tensors": named}))
        else:
            stage = self._stage_root / f"v{len(self.install_seconds)}"
            stage.mkdir(parents=True, exist_ok=True)
            try:  # a write cut short (a full /dev/shm) leaves no part of a version behind either
                write_safetensors(stage / "model.safetensors", named)
                loaded = self._write(lambda: self.llm.collective_rpc(
                    "load_grpo_weights", kwargs={"path": str(stage / "model.safetensors")}))
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        self.tied_heads_loaded = loaded[0]
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Remove this engine's stage root (weight_install=files) and `owned_dir`; vLLM ends with the process."""
        for path in (self._stage_root, self.owned_dir):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)

    def sampling_params(self, seed: int | None, greedy: bool, max_tokens: int | None = None, delta: bool = False):
        """One request's sampling: the policy's distribution, stopping at the tokenizer's stop tokens only (module
        docstring); `delta`: every step returns the request's new tokens
        (else only its finished output)."""
        from vllm import SamplingParams  # noqa: PLC0415 - deferred: vLLM lives in its own environment
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415 - deferred: as above

        return SamplingParams(n=1, temperature=0.0 if greedy else self.temperature, top_p=1.0, top_k=0, min_p=0.0,
                              max_tokens=max_tokens or self.max_new_tokens, stop_token_ids=self.eos_ids,
                              ignore_eos=True, logprobs=0, logit_bias={self.pad_id: PAD_BIAS},
                              seed=None if greedy else seed, detokenize=False,
                              output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY)

    def _request(self, ids: list[int]) -> dict:
        return {"prompt_token_ids": list(ids), "cache_salt": self.cache_salt}

    def generate(self, params: Any, prompts: list[list[int]], rng: Any, greedy: bool = False,
                 max_new_tokens: list[int] | None = None, refresh: Callable[[], tuple[Any, int] | None] | None = None,
                 version: int = 0) -> Generation:
        """Completions for `prompts` (token ids) under `params` (weight version `version`); `rng` (a JAX key or an
        int) seeds row i with seed(rng) + i; `max_new_tokens`: per-row budgets (default generation.max_new_tokens);
        `refresh`: called every sampler.vllm.steps_between_updates steps, returns newer (params, version) to go on
        with, or None; with it, `Generation.versions` records each token's version. A `serve` of a fixed set."""
        return generate_by_serving(self, params, prompts, rng, greedy, max_new_tokens, refresh, version)

    def request_keys(self, rng: Any, rows: int) -> list[int]:
        """The seed of each row of a batch generated with `rng`: row i samples with seed(rng) + i."""
        base = seed_of(rng)  # once: a JAX key's bits are read back from the device
        return [(base + i) % 2**63 for i in range(rows)]

    def serve(self, params: Any, source: RequestSource, refresh: Callable | None = None, version: int = 0) -> None:
        """`serve_alone` over `source` and the endpoint's queued requests (`side`), under its lock."""
        serve_sharing(self.side, self.serve_alone, params, source, refresh, version)

    def serve_alone(self, params: Any, source: RequestSource,
                    refresh: Callable[[], tuple[Any, int] | None] | None = None, version: int = 0) -> None:
        """Generate the requests `source` hands out until it has none left and none will come, one engine step
        (a token per live request) at a time: before every step the requests ready then enter the engine (a
        multi-turn episode's next turn enters while the others decode; its prompt, the conversation so far, reads
        the earlier turns' blocks from the prefix cache), and every ended request goes back through
        `source.finish`. Each request samples its own way (greedy, or with the seed of its key); a cancelled source
        ends the serve at the next step, its live requests aborted. `refresh` as in `generate`, and also
        called while every request waits on the source (a new version then goes in without a pause). A request's
        hold/resume fields (environment.kv_cache=hold, the JAX engine's) need nothing here: its ids are the whole
        conversation, and the prefix cache keeps the earlier turns' blocks; the hold keys the source releases are
        taken and dropped, so it does not keep them for the sampler's life."""
        params = take_weights(params)
        if params is not self._installed or self.broken is not None:  # a broken engine refuses (install)
            self.install(params)
        del params  # `_installed` holds them alone: a version installed in flight frees them (a whole host copy)
        engine, per_step = self.llm.llm_engine, refresh is not None
        pending: collections.deque = collections.deque()
        live: dict[str, Live] = {}
        self.cached_prompt_tokens = []
        steps = 0
        try:
            while not source.cancelled():
                source.released()
                vocab = self.model.arch.vocab_size  # each request as every engine checks it, naming the setting
                pending.extend(check_served(r, self.max_new_tokens, self.context_capacity, vocab, CONTEXT_FIELD)
                               for r in source.take())
                drop_withdrawn(source, pending, live, engine)
                if not pending and not live:
                    if not source.open():
                        source.released()
                        return
                    if refresh is not None:  # nothing live: no pause needed
                        update = refresh()
                        if update is not None and update[0] is not self._installed:
                            self.install(update[0])
                        version = version if update is None else update[1]
                    source.wait(0.5)
                    continue
                # in-flight updates: no more than vLLM runs at once, so none waits inside it with an old salt
                while pending and (refresh is None or len(live) < self.settings.max_num_seqs):
                    request = pending.popleft()
                    self._requests += 1
                    request_id = f"grpo-{self._requests}"  # outputs carry this id (vLLM adds a suffix inside)
                    sampling = self.sampling_params(seed_of(request.key) % 2**63, request.greedy, request.budget,
                                                    per_step)
                    engine.add_request(request_id, self._request(request.ids), sampling)
                    # a serve's first MAX_RECORDED requests only: one lasting a sampler's life must not keep them all
                    index = len(self.cached_prompt_tokens) if len(self.cached_prompt_tokens) < MAX_RECORDED else None
                    live[request_id] = Live(request, index, per_step)
                    if index is not None:
                        self.cached_prompt_tokens.append(0)
                for out in engine.step():
                    entry = live.get(out.request_id)
                    if entry is None:
                        continue
                    if entry.index is not None:
                        self.cached_prompt_tokens[entry.index] = max(self.cached_prompt_tokens[entry.index],
                                                                     out.num_cached_tokens or 0)
                    entry.add(out.outputs[0], version)
                    if out.finished:
                        check_ended(out)
                        del live[out.request_id]
                        self._finish(source, entry)
                steps += 1
                if live and not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM finished every request but returned none of {sorted(live)[:3]}")
                if refresh is not None and live and steps % self.settings.steps_between_updates == 0:
                    update = refresh()
                    if update is not None:
                        version = update[1]
                        if update[0] is not self._installed:
                            self._install_in_flight(update[0])
        finally:
            if live:  # an error left requests in the engine: the next serve must not get their outputs
                engine.abort_request(list(live))

    def _finish(self, source: RequestSource, entry: Live) -> None:
        tokens = np.asarray(entry.tokens, np.int32)
        source.finish(entry.request, tokens, np.asarray(entry.logprobs, np.float32),
                      None if entry.versions is None else np.asarray(entry.versions, np.int32),
                      bool(len(tokens)) and int(tokens[-1]) in self.eos_ids)  # the stop token ends the completion

    def _install_in_flight(self, params: Any) -> None:
        """A new version while requests run: the scheduler paused with every request kept (none scheduled until
        wake_up), the weights written in place, scheduling resumed."""
        self.llm.sleep(level=0, mode="keep")
        try:
            self.install(params, keep_requests=True)
        finally:
            self.llm.wake_up(tags=["scheduling"])
        self.pauses += 1


def build(cfg, model, tokenizer, index: int = 0) -> VllmEngine:
    """The engine registry's entry (sampler.engine=vllm): vLLM loads the architecture from a model directory."""
    gen = cfg.generation
    if cfg.model.kind == "hf":
        model_dir = resolve_model_dir(cfg.model.path)
    else:  # the tiny model has no directory: vLLM builds it from the config.json it would be exported with
        model_dir = pathlib.Path(tempfile.mkdtemp(prefix="grpo-vllm-model-"))
        write_hf_config(model_dir, model.arch, cfg.sampler_dtype(), tokenizer.eos_ids, tokenizer.pad_id)
    try:
        engine = VllmEngine(model_dir, model, tokenizer.pad_id, tokenizer.eos_ids, gen.max_prompt_tokens,
                            gen.max_new_tokens, gen.temperature, cfg.sampler.vllm, dtype=cfg.sampler_dtype(),
                            seed=cfg.run.seed * 1000 + index, in_flight=cfg.sampler.weight_updates == "in_flight",
                            context_tokens=engine_context(cfg)[0])
    except BaseException:  # a failed start leaves no directory behind (a sampler restarts after each)
        if cfg.model.kind != "hf":
            shutil.rmtree(model_dir, ignore_errors=True)
        raise
    engine.owned_dir = None if cfg.model.kind == "hf" else model_dir
    return engine
