"""On-policy distillation's teacher: a frozen model from a Hugging Face directory, checked to share the student's
tokenizer, placed on the trainer mesh as the KL reference is (sharded like the policy, never updated, no optimizer
state), and the host-side statistics of its per-token KL. The objective itself is loss.distill_advantages; the
reasoning and the estimator: docs/objective.md, "On-policy distillation"."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.model.hf_checkpoint import (ArchitectureError, CheckpointError, read_architecture,
                                                   resolve_model_dir)
from grpo_stream.common.model.policy import PolicyModel, load_hf_model
from grpo_stream.common.model.tokenizer import PAD, HFTokenizer

log = logging.getLogger(__name__)
# what both tokenizers must split alike: words, digits, the arithmetic and answer markup, punctuation and spaces
PROBE_TEXT = ("Q: Tom has 12 apples and buys 35 more. How many apples does he have?\nA: 12 + 35 = 47.  #### 47\n"
              "The quick brown fox, (jumps) over the lazy dog; 3.14 * 2 - 1 != 0! {\"x\": [1, 2]}")
QUANTILES = (0.5, 0.9, 0.99)


@dataclasses.dataclass(frozen=True)
class Teacher:
    """The distillation teacher: its model (params placed on the trainer mesh) and where it came from."""

    model: PolicyModel
    directory: str

    def num_params(self) -> int:
        return self.model.num_params()


class TeacherTokenizer(HFTokenizer):
    """The teacher's tokenizer as distillation uses it: only to compare with the student's (its errors name
    distill.teacher). Its pad is the student's pad token, looked up by text and never refused: the teacher never
    generates (its stops are never used) and scores with the student's pad excluded, so the student's pad being one
    of the teacher's stops (an instruct student padding with <|endoftext|>, a base teacher stopping at it) is no reason
    to refuse a teacher whose ids mean the same text."""

    FIELD = "distill.teacher"

    def _pad_id(self, directory, pad_token) -> int:
        pad_id = self._tok.convert_tokens_to_ids(pad_token)
        return -1 if pad_id is None else int(pad_id)  # a pad the teacher lacks: its vocabulary differs, refused there


def _shown(ids: list[int], limit: int = 24) -> str:
    return str(ids) if len(ids) <= limit else f"{ids[:limit]}... ({len(ids)} ids)"


def tokenizer_differences(student, teacher, probe: str = PROBE_TEXT) -> list[str]:
    """What differs between two tokenizers (each with vocab(), encode(), eos_ids, pad_id, bos_text): the ids
    (id_differences), then the special tokens (special_token_differences). Empty: the same."""
    return id_differences(student, teacher, probe) + special_token_differences(student, teacher)


def id_differences(student, teacher, probe: str = PROBE_TEXT) -> list[str]:
    """What makes an id mean other text to the teacher than to the student: the vocabulary (its size, then the
    tokens mapped to other ids) and the ids of `probe`. Empty: every id means the same text."""
    out = []
    sv, tv = student.vocab(), teacher.vocab()
    if len(sv) != len(tv):
        out.append(f"vocabulary size {len(sv)} (student) vs {len(tv)} (teacher)")
    moved = sorted(tok for tok in sv.keys() | tv.keys() if sv.get(tok) != tv.get(tok))
    if moved and len(sv) == len(tv):
        examples = ", ".join(f"{tok!r}: {sv.get(tok)} vs {tv.get(tok)}" for tok in moved[:5])
        out.append(f"{len(moved)} tokens map to other ids (student vs teacher), e.g. {examples}")
    s_ids, t_ids = student.encode(probe), teacher.encode(probe)
    if s_ids != t_ids:
        first = next((i for i, (a, b) in enumerate(zip(s_ids, t_ids)) if a != b), min(len(s_ids), len(t_ids)))
        out.append(f"ids of the probe text {probe[:40]!r}... differ from id {first}: student {_shown(s_ids)} vs "
                   f"teacher {_shown(t_ids)}")
    return out


def special_token_differences(student, teacher) -> list[str]:
    """The special tokens the two tokenizers' files name differently: stop ids, pad id, BOS text."""
    out = []
    for what, s, t in (("end-of-sequence ids", sorted(student.eos_ids), sorted(teacher.eos_ids)),
                       ("pad id", student.pad_id, teacher.pad_id),
                       ("BOS text", student.bos_text, teacher.bos_text)):
        if s != t:
            out.append(f"special tokens: {what} {s!r} (student) vs {t!r} (teacher)")
    return out


def student_source(cfg: RunConfig) -> str:
    """How the student's tokenizer is named in errors."""
    if cfg.model.kind == "hf":
        return f"model.path={cfg.model.path}"
    return (f"the tiny model's tokenizer (model.kind=tiny: a BPE of vocab_size {cfg.model.tiny.vocab_size} trained "
            f"on task.name={cfg.task.name}'s text)")


def check_teacher_tokenizer(cfg: RunConfig, student, directory) -> HFTokenizer:
    """The teacher's tokenizer, read from `directory`; a ConfigError naming both tokenizers and what differs when
    an id means other text to it than to the student (a teacher scores the student's token ids, so they must mean
    the same text). Other special tokens are logged, not refused: the teacher scores the ids the student's
    tokenizer wrote (prompt and BOS included), with the student's pad excluded, and never generates, so its own
    stop, pad and BOS tokens are never used; a base student of an instruct teacher's family (Qwen3-8B-Base from
    Qwen3-32B: another stop set) is the usual case."""
    # the student's pad, by its text: the teacher's files may name another pad token or none (the teacher's own is
    # never used), which is no reason to refuse it
    pad = PAD if cfg.model.kind != "hf" else next((t for t, i in student.vocab().items() if i == student.pad_id),
                                                  cfg.model.pad_token)
    arch = read_architecture(directory, "distill.teacher")
    try:
        teacher = TeacherTokenizer(directory, pad, vocab_size=arch.vocab_size)
    except ValueError as exc:  # its messages name distill.teacher (TeacherTokenizer.FIELD)
        raise ConfigError(f"{exc} (the teacher's tokenizer must be the student's: {student_source(cfg)})") from None
    differences = id_differences(student, teacher)
    if differences:
        raise ConfigError(f"distill.teacher={cfg.distill.teacher}: the teacher's tokenizer ({directory}) differs from "
                          f"the student's ({student_source(cfg)}): " + "; ".join(differences) +
                          ". A teacher must share the student's tokenizer: pick a teacher of the student's family "
                          "and tokenizer (it may be larger), or distill into a student with the teacher's tokenizer")
    special = special_token_differences(student, teacher)
    if special:
        log.warning("distill.teacher=%s: the teacher's tokenizer files name other special tokens than the "
                    "student's (%s): its ids mean the same text, and the teacher only scores the student's ids, so "
                    "the student's stop, pad and BOS tokens apply", cfg.distill.teacher, "; ".join(special))
    # the student samples from every row of its embedding (a checkpoint's is often padded past the tokenizer:
    # Qwen2.5-7B's 152064 rows over 151665 tokens), and the teacher must score each id sampled: an id past the
    # teacher's rows gets a NaN log-prob (and a NaN update) or another token's
    sampled = max(len(student.vocab()), int(student.vocab_size))
    if arch.vocab_size < sampled:
        raise ConfigError(f"distill.teacher={cfg.distill.teacher}: its embedding has {arch.vocab_size} rows, fewer "
                          f"than the {sampled} token ids the student can sample ({student_source(cfg)}: "
                          f"{len(student.vocab())} tokens in the shared tokenizer, {student.vocab_size} rows in the "
                          f"student's embedding), so the teacher cannot score every id the student writes. Pick a "
                          f"teacher whose embedding has at least {sampled} rows (config.json's vocab_size)")
    return teacher


def load_teacher(cfg: RunConfig, student_tokenizer, mesh) -> Teacher | None:
    """The run's teacher (None without distill.teacher): tokenizer checked, weights loaded in distill.dtype and
    placed on `mesh` as the policy's are (sharded over fsdp x tp, frozen)."""
    d = cfg.distill
    if not d.enabled:
        return None
    try:
        directory = resolve_model_dir(d.teacher, "distill.teacher")
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    try:
        check_teacher_tokenizer(cfg, student_tokenizer, directory)
        model = load_hf_model(str(directory), cfg.model.dtype if d.dtype == "model" else d.dtype, mesh)
    except (CheckpointError, ArchitectureError) as exc:
        raise ConfigError(f"distill.teacher={d.teacher}: the teacher cannot be loaded: {exc}") from None
    log.info("distillation teacher %s: %d parameters (%s), kl_coef %g, reward_weight %g", directory,
             model.num_params(), model.arch.family, d.kl_coef, d.reward_weight)
    return Teacher(model, str(directory))


def distill_quantiles(kl: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
    """distill_kl_p50 / _p90 / _p99: quantiles (numpy's linear interpolation) of the per-token KL estimates `kl`
    ([B, T]) on the tokens of `mask`; 0 when no token is in the loss."""
    values = kl[np.asarray(mask) > 0]
    qs = np.quantile(values, QUANTILES) if values.size else np.zeros(len(QUANTILES))
    return {f"distill_kl_p{round(q * 100)}": float(v) for q, v in zip(QUANTILES, qs)}
