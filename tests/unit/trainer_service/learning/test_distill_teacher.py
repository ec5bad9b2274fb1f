"""The distillation teacher at start-up: a Hugging Face directory of another family and a larger shape than the
student loads onto the trainer mesh when it shares the student's tokenizer, and is refused, naming both
tokenizers and what differs, when it does not. Also the distill section's own checks."""

import pathlib

import jax
import pytest

from grpo_stream.common.assembly.parts import build_task_and_tokenizer
from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.hf_checkpoint import export_hf
from grpo_stream.common.model.policy import build_from_architecture
from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.model.tokenizer import train_bpe
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.trainer_service.learning.distill import load_teacher, tokenizer_differences

ROOT = pathlib.Path(__file__).resolve().parents[4]
SMOKE = ["model.tiny.num_layers=1", "model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.head_dim=16"]


def write_teacher(directory: pathlib.Path, tokenizer, rows: int | None = None,
                  eos_ids: list[int] | None = None) -> pathlib.Path:
    """A Qwen2 teacher (the student is Qwen3-style), wider and deeper than the student, with `tokenizer` (and an
    embedding of `rows` rows, default one a token; stop ids `eos_ids`, default the tokenizer's)."""
    tokenizer.save(directory)
    arch = Architecture(family="qwen2", vocab_size=rows or tokenizer.vocab_size, num_layers=2, embed_dim=64, hidden_dim=128,
                        num_heads=4, num_kv_heads=2, head_dim=16, norm_eps=1e-6, rope_theta=1e6,
                        tied_embeddings=True)
    named = build_from_architecture(arch, seed=3).to_named_numpy()
    return export_hf(directory, arch, named, tokenizer_dir=directory, eos_ids=eos_ids or tokenizer.eos_ids,
                     pad_id=tokenizer.pad_id)


def config(teacher: pathlib.Path, *more: str):
    return load_config(ROOT / "configs/tiny_arith.yaml", [*SMOKE, f"distill.teacher={teacher}", *more])


def test_a_teacher_sharing_the_tokenizer_loads_on_the_mesh_larger_than_the_student(tmp_path):
    cfg = config(tmp_path / "teacher")
    _, student = build_task_and_tokenizer(cfg)
    write_teacher(tmp_path / "teacher", student)  # the tiny model's tokenizer, exported: the same one
    mesh = make_mesh(1, 1, jax.devices(), "trainer.mesh")
    teacher = load_teacher(cfg, student, mesh)
    assert teacher.model.arch.family == "qwen2" and teacher.num_params() > 2 * 30_000
    leaf = jax.tree.leaves(teacher.model.params)[0]
    assert leaf.sharding.mesh == mesh  # placed as the policy's params are
    assert load_teacher(config(tmp_path / "teacher", "distill.teacher=null"), student, mesh) is None


def test_a_teacher_with_another_vocabulary_is_refused_naming_both(tmp_path):
    cfg = config(tmp_path / "teacher")
    _, student = build_task_and_tokenizer(cfg)
    write_teacher(tmp_path / "teacher", train_bpe(ArithTask(10, 99, 0.1, seed=0).corpus(4000), 150))
    with pytest.raises(ConfigError) as err:
        load_teacher(cfg, student, make_mesh(1, 1, jax.devices(), "trainer.mesh"))
    message = str(err.value)
    assert f"distill.teacher={tmp_path / 'teacher'}" in message
    assert "model.kind=tiny" in message and "vocab_size 160" in message  # the student's, named
    assert "vocabulary size 160 (student) vs 150 (teacher)" in message
    assert "ids of the probe text" in message


def test_a_teacher_with_other_stop_tokens_but_the_same_ids_loads_with_a_warning(tmp_path, caplog):
    # Qwen3-8B-Base (stops at <|endoftext|>) distilled from Qwen3-32B (also at <|im_end|>): every id means the same
    # text, and the teacher only scores the student's ids, so its own stop tokens never matter
    cfg = config(tmp_path / "teacher")
    _, student = build_task_and_tokenizer(cfg)
    unk = student.vocab()["<unk>"]
    write_teacher(tmp_path / "teacher", student, eos_ids=[*student.eos_ids, unk])
    with caplog.at_level("WARNING", logger="grpo_stream.trainer_service.learning.distill"):
        teacher = load_teacher(cfg, student, make_mesh(1, 1, jax.devices(), "trainer.mesh"))
    assert teacher.model.arch.family == "qwen2"
    assert f"end-of-sequence ids [1] (student) vs [1, {unk}] (teacher)" in caplog.text



def test_a_teacher_that_stops_at_the_students_pad_loads(tmp_path):
    # an instruct student padding with <|endoftext|> (SmolLM2's pad) distilled from a base teacher that stops there:
    # the ids mean the same text and the teacher never generates, so its stops never matter (it was refused, telling
    # the user to change model.pad_token)
    cfg = config(tmp_path / "teacher")
    _, student = build_task_and_tokenizer(cfg)
    write_teacher(tmp_path / "teacher", student, eos_ids=[*student.eos_ids, student.pad_id])
    teacher = load_teacher(cfg, student, make_mesh(1, 1, jax.devices(), "trainer.mesh"))
    assert teacher.model.arch.family == "qwen2"


def test_a_teacher_directory_without_a_model_is_refused_naming_distill_teacher(tmp_path):
    cfg = config(tmp_path / "teacher")
    _, student = build_task_and_tokenizer(cfg)
    mesh = make_mesh(1, 1, jax.devices(), "trainer.mesh")
    (tmp_path / "teacher").mkdir()
    with pytest.raises(ConfigError, match="distill.teacher=.*no config.json; point distill.teacher at") as err:
        load_teacher(cfg, student, mesh)
    assert "model.path" not in str(err.value)  # the student's field, not the one to fix
    write_teacher(tmp_path / "teacher", student)
    for weights in (tmp_path / "teacher").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ConfigError, match="distill.teacher=.*cannot be loaded: .*no \\*.safetensors files"):
        load_teacher(cfg, student, mesh)

def test_a_teacher_with_fewer_embedding_rows_than_the_student_samples_from_is_refused(tmp_path):
    # the student's checkpoint pads its embedding past the tokenizer (Qwen2.5-7B: 152064 rows over 151665 tokens) and
    # samples from every row; a teacher with only the tokenizer's rows would score ids past them as NaN
    _, tiny = build_task_and_tokenizer(config(tmp_path / "teacher"))
    write_teacher(tmp_path / "student", tiny, rows=tiny.vocab_size + 96)
    write_teacher(tmp_path / "teacher", tiny)
    cfg = config(tmp_path / "teacher", "model.kind=hf", f"model.path={tmp_path / 'student'}", "warmstart.steps=0")
    _, student = build_task_and_tokenizer(cfg)
    assert student.vocab_size == tiny.vocab_size + 96 and len(student.vocab()) == tiny.vocab_size
    mesh = make_mesh(1, 1, jax.devices(), "trainer.mesh")
    with pytest.raises(ConfigError, match=f"distill.teacher=.*{tiny.vocab_size} rows, fewer than the "
                                          f"{tiny.vocab_size + 96} token ids the student can sample"):
        load_teacher(cfg, student, mesh)
    write_teacher(tmp_path / "teacher", tiny, rows=tiny.vocab_size + 96)  # as many rows: it loads
    assert load_teacher(cfg, student, mesh).model.arch.vocab_size == tiny.vocab_size + 96


def test_tokenizer_differences_name_ids_and_special_tokens(tmp_path):
    corpus = ArithTask(10, 99, 0.1, seed=0).corpus(4000)
    a, b = train_bpe(corpus, 160), train_bpe(corpus[::-1][:1500], 160)  # same size, other merges
    assert tokenizer_differences(a, train_bpe(corpus, 160)) == []
    found = " | ".join(tokenizer_differences(a, b))
    assert "tokens map to other ids" in found and "ids of the probe text" in found, found

    class Other:  # the same vocabulary and ids, other special tokens
        def __init__(self, tok):
            self.vocab, self.encode, self.eos_ids, self.pad_id, self.bos_text = tok.vocab, tok.encode, [7], 3, "<s>"

    found = " | ".join(tokenizer_differences(a, Other(a)))
    assert "end-of-sequence ids [1] (student) vs [7] (teacher)" in found and "pad id 0 (student) vs 3" in found
    assert "BOS text '' (student) vs '<s>' (teacher)" in found and "vocabulary" not in found


def test_the_distill_section_is_strict_and_refuses_filtering_its_groups(tmp_path):
    cfg = config(tmp_path / "t")
    assert cfg.distill.enabled and cfg.distill.kl_coef == 1.0 and cfg.distill.reward_weight == 0.0
    assert not load_config(ROOT / "configs/tiny_arith.yaml", []).distill.enabled
    with pytest.raises(ValueError, match="distill.colour"):
        config(tmp_path / "t", "distill.colour=1")
    with pytest.raises(ValueError, match="kl_coef"):
        config(tmp_path / "t", "distill.kl_coef=0")
    with pytest.raises(ValueError, match="algo.dynamic_sampling.*distill.reward_weight=0"):
        config(tmp_path / "t", "algo.dynamic_sampling=true")
    assert config(tmp_path / "t", "algo.dynamic_sampling=true", "distill.reward_weight=1").algo.dynamic_sampling
    # the penalty lowers rewards, which reach the advantage only with a reward weight: it did nothing, silently
    with pytest.raises(ValueError, match="algo.overlong=penalty.*distill.reward_weight=0"):
        config(tmp_path / "t", "algo.overlong=penalty")
    assert config(tmp_path / "t", "algo.overlong=penalty", "distill.reward_weight=0.5").algo.overlong == "penalty"
    assert config(tmp_path / "t", "algo.overlong=filter").algo.overlong == "filter"
