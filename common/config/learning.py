"""The config sections of what is learned and how: the model, generation, and the RL objective (the task and its
data: task.py). The deployment sections (processes, transports, storage) and the whole RunConfig are in schema.py."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from grpo_stream.common.config.access import BATCH_BYTES, MAX_MESSAGE_BYTES
from grpo_stream.common.config.base import FilePath, Strict


class TinyModelSection(Strict):
    """A small Qwen3-architecture model built from scratch with a locally trained tokenizer."""

    vocab_size: int = Field(160, ge=40, le=4096, description="BPE vocabulary size of the local tokenizer.")
    num_layers: int = Field(2, ge=1, le=24, description="Decoder layers.")
    embed_dim: int = Field(128, ge=16, le=4096, description="Model width.")
    hidden_dim: int = Field(384, ge=16, le=16384, description="MLP hidden width.")
    num_heads: int = Field(4, ge=1, le=64, description="Query heads.")
    num_kv_heads: int = Field(2, ge=1, le=64, description="Key/value heads (must divide num_heads).")
    head_dim: int = Field(32, ge=8, le=256, description="Width of one attention head.")

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelSection":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.tiny.num_kv_heads={self.num_kv_heads} must divide "
                             f"model.tiny.num_heads={self.num_heads}")
        return self


# Gemma keeps q, k and v in one qkv_einsum when it has as many key/value heads as query heads, else in q_einsum and
# kv_einsum
LORA_DEFAULT_TARGETS = (".*/(q_proj|k_proj|v_proj|o_proj|q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum|gate_proj|"
                        "up_proj|down_proj)")


class LoraSection(Strict):
    """Low-rank adapters (qwix, the library Tunix uses): W + (alpha / rank) A B on the weights of the modules
    `targets` matches; only A and B are trained and held by the optimizer."""

    rank: int = Field(16, ge=1, le=1024, description="Rank r of each adapter (A: [in, r], B: [r, out]).")
    alpha: float = Field(32.0, gt=0, le=1e4, description="Adapter scale numerator: the update is (alpha / rank) A B.")
    targets: str = Field(LORA_DEFAULT_TARGETS, min_length=1, description="Regular expression, matched in full "
                         "against module paths such as 'layers/3/attn/q_proj' or 'layers/3/mlp/down_proj': the "
                         "projections that get adapters. The default adapts every attention and MLP projection, "
                         "never the embeddings or the output head (a pattern of your own matching 'lm_head', a "
                         "path with no '/' before it, adapts an untied output head: '.*/(q_proj|v_proj)|lm_head'; "
                         "the embedding table, and a head tied to it, are never adapted: docs/lora.md). A part of "
                         "the pattern that adapts nothing is refused, naming it.")

    @model_validator(mode="after")
    def _regex(self) -> "LoraSection":
        try:
            re.compile(self.targets)
        except re.error as exc:
            raise ValueError(f"model.lora.targets: not a regular expression ({exc}); e.g. '.*/(q_proj|v_proj)'")
        return self


class ModelSection(Strict):
    kind: Literal["tiny", "hf"] = Field("tiny", description="'tiny': Qwen3-style model built from scratch for CPU "
                                        "runs; 'hf': a Hugging Face checkpoint directory (model.path).")
    tiny: TinyModelSection = Field(default_factory=TinyModelSection, description="Architecture of the tiny model.")
    path: FilePath = Field(None, description="kind=hf: a local directory with config.json, *.safetensors and the "
                             "tokenizer files (Llama 3.x, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 text), or a hub id "
                             "(org/name) taken from the Hugging Face cache or downloaded where a network exists.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter (and compute) dtype: the tiny "
                                                  "model's at init, a checkpoint's after loading. With bfloat16 the "
                                                  "trainer's optimizer keeps float32 state (trainer.optimizer."
                                                  "state_dtype).")
    pad_token: str | None = Field(None, description="kind=hf: token used for padding when the tokenizer defines none "
                                  "(it must not be an end-of-sequence token; Llama 3: <|finetune_right_pad_id|>). "
                                  "Null: the tokenizer's pad token (one that is a stop token, as in many HF files, is "
                                  "refused naming safe candidates). 'auto': the first special token that is not a "
                                  "stop, BOS or chat-template token (pad-like names first, then end-of-text ones: "
                                  "SmolLM2's <|endoftext|>), logged.")
    lora: LoraSection | None = Field(None, description="LoRA fine-tuning: null trains every parameter; a section "
                                     "(e.g. model.lora.rank=8) freezes the base and trains adapters only. Samplers, "
                                     "evaluation and the exported model get the merged weights W + (alpha/rank) A B.")

    @model_validator(mode="after")
    def _path(self) -> "ModelSection":
        if self.kind == "hf" and not self.path:
            raise ValueError("model.kind=hf needs model.path: a local Hugging Face model directory")
        return self


class GenerationSection(Strict):
    num_generations: int = Field(8, ge=2, le=256, description="Completions sampled per prompt (the GRPO group size).")
    max_prompt_tokens: int = Field(32, ge=4, le=32768, description="Prompts are left-padded to this many tokens; "
                                   "longer prompts are skipped by samplers.")
    max_new_tokens: int = Field(16, ge=1, le=32768, description="Completion length limit.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature; the trainer computes its "
                               "logprobs at the same temperature.")
    decode_slots: int = Field(256, ge=1, le=65536, description="JAX engine: most sequences decoded at once (its "
                              "KV cache holds this many x (max_prompt_tokens + max_new_tokens) tokens); a request "
                              "set uses the smallest slot count of a ladder (8, 12, 16, 24, ...) that holds it, and "
                              "ended sequences' slots are "
                              "refilled from the pending rows.")
    decode_chunk_steps: int = Field(16, ge=1, le=4096, description="JAX engine: most decode steps the device runs "
                                    "between two host scheduling points (refills, weight updates); a chunk ends "
                                    "early when rows wait for slots.")
    decode_length_groups: int = Field(1, ge=1, le=2, description="JAX engine: 2 lets sequences that outgrow the "
                                      "attention window of the others move to a second slot group with a longer "
                                      "window (chosen by a cost model; one weight pass for both), so a few long "
                                      "completions do not make every slot attend over their length: fewer "
                                      "cache reads, more compiled programs (BENCHMARKS.md); 1 keeps one window "
                                      "for all slots.")
    decode_attention: Literal["auto", "dense"] = Field("auto", description="JAX engine: 'auto' lets a float32 "
                                                       "sampler on one CPU device attend over each slot's own "
                                                       "positions with a C++ kernel built on first use (the "
                                                       "system's c++ compiler; without one it says so and stays "
                                                       "dense); 'dense' is XLA's attention over the slot group's "
                                                       "whole window, what GPUs and TPUs use.")

    @model_validator(mode="after")
    def _group_fits_a_message(self) -> "GenerationSection":
        # a group travels whole in one message, 9 bytes a completion token at most (id, logprob, model mask)
        largest = self.num_generations * self.max_new_tokens * 9 + self.max_prompt_tokens * 5
        if largest > BATCH_BYTES:
            raise ValueError(f"a group of generation.num_generations={self.num_generations} completions of up to "
                             f"generation.max_new_tokens={self.max_new_tokens} tokens can be {largest / 2**20:.0f} MiB, "
                             f"over the {MAX_MESSAGE_BYTES >> 20} MiB a rollout message carries; lower either")
        return self


# (epsilon, epsilon_high) of each loss when the config sets neither: PPO's 0.2 for GRPO's token ratios; for GSPO's
# length-normalised sequence ratio, the GSPO paper's ranges (Zheng et al. 2025: 3e-4 / 4e-4)
CLIP_DEFAULTS = {"grpo": (0.2, 0.2), "gspo-token": (3e-4, 4e-4)}
GSPO_CLIP_LIMIT = 0.1  # a GSPO clip range at least this wide is GRPO's scale, and refused


class AlgoSection(Strict):
    """The policy-gradient objective; see trainer_service/learning/loss.py and docs/objective.md for the formula."""

    loss_algo: Literal["grpo", "gspo-token"] = Field("grpo", description="'grpo': per-token ratio against the "
                                                     "trainer's weights at the step's start, with truncated importance "
                                                     "weights (tis_cap) for the sampler's staleness; 'gspo-token': "
                                                     "GSPO's sequence-level ratio (geometric mean of the token ratios) "
                                                     "against the sampler's policy, with per-token gradients.")
    epsilon: float | None = Field(None, gt=0, lt=1, description="Lower clip range of the ratio (1 - epsilon). "
                                  "null = the loss's own: 0.2 for grpo; 3e-4 for gspo-token, whose ratio is a "
                                  "length-normalised sequence ratio against the sampler's policy (the GSPO paper's "
                                  "range: at 0.2 it almost never binds, and stale sequences train unclipped).")
    epsilon_high: float | None = Field(None, gt=0, lt=10, description="Upper clip range (1 + epsilon_high), "
                                       ">= epsilon ('clip-higher'); null = epsilon when that is set, else the loss's "
                                       "own: 0.2 for grpo, 4e-4 for gspo-token.")
    loss_agg_mode: Literal["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses become one number: mean over all tokens; mean over "
        "sequences of each sequence's token mean; or Dr.GRPO's token sum divided by the number of sequences.")
    advantage_estimator: Literal["grpo", "drgrpo", "rloo"] = Field("grpo", description="'grpo': (r-mean)/(std+eps) "
                                                                   "per group; 'drgrpo': r-mean; 'rloo': r minus "
                                                                   "the mean of the other completions.")
    advantage_eps: float = Field(1e-4, gt=0, description="Added to the group std when normalising advantages.")
    beta: float = Field(0.0, ge=0, le=100, description="Weight of the KL penalty to a frozen reference model "
                        "(the policy when RL starts). 0 = no penalty and no reference model in memory.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator with d = ref - logp: "
                                                   "k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1.")
    tis_cap: float | None = Field(2.0, gt=0, le=1e6, description="Truncated importance weight min(exp(old - "
                                  "behaviour), tis_cap) per token, correcting for the sampler's (stale) policy; "
                                  "null = off. grpo only: gspo-token's ratio is taken against the sampler's policy "
                                  "itself, so it is the importance weight.")
    num_iterations: int = Field(1, ge=1, le=64, description="Optimizer passes over each batch (PPO epochs).")
    minibatches: int = Field(1, ge=1, le=4096, description="Optimizer steps per pass; must divide the batch's "
                             "sequences (trainer.groups_per_step x generation.num_generations).")
    dynamic_sampling: bool = Field(False, description="Drop groups whose training rewards (with overlong=penalty, "
                                   "the penalty included) are all equal (no signal) before batching, and with "
                                   "overlong=filter those whose completions not truncated all have zero advantage; "
                                   "they are counted as groups_dropped_filtered and the batch is refilled.")
    overlong: Literal["none", "filter", "penalty"] = Field("none", description="Completions that hit "
                                                          "max_new_tokens: 'filter' masks them out of the loss; "
                                                          "'penalty' lowers their reward near the limit.")
    overlong_buffer_tokens: int = Field(4, ge=1, le=32768, description="'penalty': the penalty ramps up linearly over "
                                        "this many tokens before max_new_tokens.")
    overlong_penalty: float = Field(1.0, ge=0, le=100, description="'penalty': reward subtracted at the limit.")

    @model_validator(mode="after")
    def _clip(self) -> "AlgoSection":
        if self.epsilon_high is not None and self.epsilon_high < self.eps_low:
            raise ValueError(f"algo.epsilon_high={self.epsilon_high} < algo.epsilon={self.eps_low}: the upper clip "
                             "range must be at least the lower one (clip-higher); raise epsilon_high or set it null")
        if self.loss_algo == "gspo-token" and max(self.eps_low, self.eps_high) >= GSPO_CLIP_LIMIT:
            raise ValueError(f"algo.epsilon={self.epsilon}, epsilon_high={self.epsilon_high} with "
                             f"loss_algo=gspo-token: GSPO clips the mean per-token log-ratio against the sampler's "
                             f"policy, which a clip range of {GSPO_CLIP_LIMIT} or more almost never bounds, so stale "
                             "sequences train unclipped (docs/objective.md); set both null for GSPO's own 3e-4 / "
                             "4e-4, or values below 0.1")
        return self

    @property
    def eps_low(self) -> float:
        """The lower clip range in effect: epsilon, or the loss's own (CLIP_DEFAULTS)."""
        return self.epsilon if self.epsilon is not None else CLIP_DEFAULTS[self.loss_algo][0]

    @property
    def eps_high(self) -> float:
        """The upper clip range in effect: epsilon_high; else epsilon when set; else the loss's own."""
        if self.epsilon_high is not None:
            return self.epsilon_high
        return self.epsilon if self.epsilon is not None else CLIP_DEFAULTS[self.loss_algo][1]


class DistillSection(Strict):
    """On-policy distillation (docs/objective.md, "On-policy distillation"): a frozen teacher scores every token the
    student sampled, and each token's advantage is -kl_coef x (student log-prob - teacher log-prob), the
    single-sample estimate of the reverse KL(student || teacher) at that token, plus reward_weight x the group's
    reward advantage. The teacher sits on the trainer mesh like the KL reference model (sharded, frozen, no optimizer
    state) and must share the student's tokenizer; it may be larger than the student."""

    teacher: str | None = Field(None, description="A Hugging Face model directory (config.json, *.safetensors, the "
                                "tokenizer files; any family model.kind=hf loads) or a hub id in the local cache: "
                                "the teacher. Its tokenizer must give every id the student's text (vocabulary, ids "
                                "of a probe text; other stop, pad or BOS tokens are only logged) and its embedding "
                                "at least the student's rows, checked at start-up. Null: no distillation.")
    kl_coef: float = Field(1.0, gt=0, le=100, description="Coefficient of the per-token reverse-KL advantage "
                           "-kl_coef x (log pi_student(y_t) - log pi_teacher(y_t)).")
    reward_weight: float = Field(0.0, ge=0, le=100, description="Weight of the group-relative reward advantage "
                                 "(algo.advantage_estimator) added to the distillation advantage: 0 = distillation "
                                 "alone (rewards are only reported), 1 = both at full weight.")
    dtype: Literal["model", "float32", "bfloat16"] = Field("model", description="The teacher's parameter and "
                                                           "compute dtype; 'model': model.dtype.")

    @field_validator("teacher")
    @classmethod
    def _named(cls, teacher: str | None) -> str | None:
        if teacher is not None and not teacher.strip():  # `distill.teacher=` meant off, and ran distillation
            raise ValueError("empty: name the teacher's model directory or hub id, or set distill.teacher=null for "
                             "no distillation")
        return teacher

    @property
    def enabled(self) -> bool:
        return self.teacher is not None


class OptimizerSection(Strict):
    """The RL phase's optimizer (trainer.optimizer): a global-norm clip (trainer.max_grad_norm), then Adam or AdamW,
    at trainer.learning_rate shaped by a schedule. Schedule lengths are in trainer steps; with several optimizer
    updates per step (algo.num_iterations x algo.minibatches) each step advances the schedule that many updates."""

    name: Literal["adam", "adamw"] = Field("adam", description="'adam', or 'adamw': Adam with decoupled weight "
                                           "decay (Loshchilov & Hutter), as MaxText and Tunix's RL recipes use.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW's decoupled weight decay, applied to every "
                                "parameter at each update, scaled by the scheduled rate (0.1 is common). Only "
                                "with name=adamw.")
    b1: float = Field(0.9, ge=0, lt=1, description="Adam's first-moment decay.")
    b2: float = Field(0.999, ge=0, lt=1, description="Adam's second-moment decay (0.99 or 0.95 are common for RL "
                      "on large models).")
    eps: float = Field(1e-8, gt=0, le=1e-2, description="Adam's denominator epsilon.")
    schedule: Literal["constant", "warmup_constant", "warmup_cosine"] = Field(
        "constant", description="Learning-rate schedule: 'constant'; 'warmup_constant': linear warmup from 0 over "
        "warmup_steps, then constant; 'warmup_cosine': linear warmup, then cosine decay to "
        "end_lr_factor x learning_rate at decay_steps.")
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="Trainer steps of linear warmup (schedules "
                              "'warmup_*').")
    decay_steps: int | None = Field(None, ge=1, le=10_000_000, description="'warmup_cosine': trainer step at which "
                                    "the decay ends (warmup included); null = trainer.steps.")
    end_lr_factor: float = Field(0.0, ge=0, le=1, description="'warmup_cosine': final rate as a fraction of "
                                 "trainer.learning_rate.")
    state_dtype: Literal["float32", "params"] = Field(
        "float32", description="With parameters below float32 (model.dtype=bfloat16): 'float32' keeps a float32 "
        "master copy of the parameters and float32 moments in the optimizer state (updates below bfloat16's "
        "resolution accumulate instead of rounding away; 8 more bytes per parameter than 'params': 12 against 4); "
        "'params': moments in the parameters' dtype, no copy. Float32 parameters are unaffected.")

    @model_validator(mode="after")
    def _consistent(self) -> "OptimizerSection":
        if self.weight_decay and self.name != "adamw":
            raise ValueError(f"trainer.optimizer.weight_decay={self.weight_decay} needs trainer.optimizer.name=adamw "
                             "(plain Adam has no decoupled decay)")
        if self.schedule == "constant" and self.warmup_steps:
            raise ValueError(f"trainer.optimizer.warmup_steps={self.warmup_steps} with schedule=constant: choose "
                             "schedule warmup_constant or warmup_cosine")
        if self.schedule == "warmup_cosine" and self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"trainer.optimizer.decay_steps={self.decay_steps} must be above warmup_steps="
                             f"{self.warmup_steps} (the step where decay ends, warmup included)")
        return self

    def schedule_problem(self, steps: int) -> str | None:
        """Why this schedule makes no sense over a run of trainer.steps=`steps` (naming the fields and the fix), or
        None."""
        if self.schedule != "warmup_cosine":
            return None
        if self.decay_steps is None and steps <= self.warmup_steps:
            return (f"trainer.optimizer.warmup_steps={self.warmup_steps} leaves no cosine decay within "
                    f"trainer.steps={steps}: lower it or set trainer.optimizer.decay_steps")
        if self.decay_steps is not None and self.decay_steps < steps and self.end_lr_factor == 0:
            # optax holds the schedule at its end value past decay_steps: every later step's update (AdamW's decay,
            # scaled by the rate, too) is zero, while the run goes on sampling, training and publishing
            return (f"trainer.optimizer.decay_steps={self.decay_steps} < trainer.steps={steps} with "
                    "trainer.optimizer.end_lr_factor=0: the learning rate is 0 after step "
                    f"{self.decay_steps}, so steps {self.decay_steps + 1}..{steps} would change nothing; set "
                    "decay_steps to trainer.steps (or null), or give end_lr_factor a floor (e.g. 0.1)")
        return None


class WarmStartSection(Strict):
    steps: int = Field(0, ge=0, le=1_000_000, description="Supervised steps before RL (0 = none).")
    batch_size: int = Field(64, ge=1, le=65536, description="Demonstrations per supervised step.")
    learning_rate: float = Field(2e-3, gt=0, le=1, description="Adam learning rate of the warm start.")
    carry_drop_prob: float = Field(0.6, ge=0, le=1, description="Arith demonstrations forget the units carry with this "
                                   "probability: a systematic error that RL can fix.")
    tool_prob: float = Field(0.5, ge=0, le=1, description="task.name=arith_tools: demonstrations call the calculator "
                             "tool with this probability (else they answer at once, as arith's do).")
    export: bool = Field(False, description="Also write the warm-started model as a Hugging Face directory, "
                         "RUN_DIR/warmstart-model: later runs start RL from it with model.kind=hf, "
                         "model.path=RUN_DIR/warmstart-model and warmstart.steps=0, without repeating the warm start.")


class EvalSection(Strict):
    num_problems: int = Field(256, ge=1, le=100_000, description="Held-out problems scored (greedy pass@1).")
    batch_size: int = Field(128, ge=1, le=65536, description="Episodes the evaluation keeps in flight (one "
                            "problem's eval.samples together when that is more), at most generation.decode_slots: "
                            "the rows of its KV cache on each trainer device (grpo-stream plan's `evaluation` line).")
    samples: int = Field(0, ge=0, le=1024, description="Sampled completions per problem for pass@k and maj@k "
                         "(at generation.temperature); 0 = greedy pass@1 only.")
    ks: list[Annotated[int, Field(ge=1)]] = Field([1], min_length=1, description="The k of pass@k and maj@k; each "
                                                  "at most eval.samples.")
    every_steps: int = Field(0, ge=0, le=1_000_000, description="Also evaluate during RL: the weights published "
                             "after every this many steps (a multiple of trainer.publish_every), on a background "
                             "thread of trainer process 0 while the steps go on, with the same figures as "
                             "eval_before/eval_after; a version due while one evaluation runs and another waits "
                             "replaces the waiting one (skipped, counted). 0 = off (docs/operations.md, \"Evaluation "
                             "during the run\").")
    max_share: float = Field(1.0, gt=0, le=1, description="With every_steps: the largest share of wall time the "
                             "background evaluation computes; it pauses between groups of episodes for the rest, so "
                             "it takes its devices (or CPU cores) from the training steps for at most this share. "
                             "1 = never pauses (fastest curve; the steps share the devices with it).")
