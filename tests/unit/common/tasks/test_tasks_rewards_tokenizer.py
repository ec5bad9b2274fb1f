import pytest

from grpo_stream.common.tasks.answers import extract_answer
from grpo_stream.common.tasks.rewards import answer_correct, score
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.common.tasks.arith_tools import ArithToolsTask
from grpo_stream.common.model.tokenizer import train_bpe


def test_heldout_pairs_never_appear_in_training():
    task = ArithTask(10, 99, 0.1, seed=0)
    held = {(p.a, p.b) for p in task.heldout(300)}
    train = {(task.train_problem(i).a, task.train_problem(i).b) for i in range(5000)}
    assert held and not held & train


def test_shards_partition_the_stream():
    task = ArithTask(10, 99, 0.1, seed=0)
    s0 = [p.prompt_id for p, _ in zip(task.train_stream(0, 2), range(5))]
    s1 = [p.prompt_id for p, _ in zip(task.train_stream(1, 2), range(5))]
    assert not set(s0) & set(s1)
    assert s0[:2] == ["arith-train-0", "arith-train-2"] and s1[:2] == ["arith-train-1", "arith-train-3"]


def test_demonstration_forgets_only_the_units_carry():
    task = ArithTask(10, 99, 0.1, seed=0)
    p = task._problem(__import__("random").Random(0), 47, 38, "x")
    assert p.demonstration() == " 47 + 38 = 85 #### 85"
    assert p.demonstration(drop_carry=True) == " 47 + 38 = 75 #### 75"
    q = task._problem(__import__("random").Random(0), 41, 38, "y")
    assert q.demonstration(drop_carry=True) == q.demonstration() and not q.has_carry()


def test_reward_reads_the_gsm8k_answer():
    assert extract_answer(" 47 + 38 = 85 #### 85") == "85"
    assert extract_answer("so #### 1,234") == "1,234"
    assert extract_answer("no answer") is None
    assert answer_correct(" 47 + 38 = 85 #### 85", "85") == 1.0
    assert answer_correct(" 47 + 38 = 75 #### 75", "85") == 0.0
    assert answer_correct("#### 85.0", "85") == 1.0
    total, parts = score(" x #### 85", "85")
    assert parts == {"answer_correct": 1.0, "answer_format": 1.0} and abs(total - 1.1) < 1e-9
    assert score("85", "85")[0] == 0.0


def test_tokenizer_is_deterministic_and_splits_digits():
    task = ArithTask(10, 99, 0.1, seed=0)
    a, b = train_bpe(task.corpus(1000), 120), train_bpe(task.corpus(1000), 120)
    assert a.fingerprint() == b.fingerprint()
    ids = a.encode(" 47 + 38 = 85 #### 85")
    assert a.decode(ids) == " 47 + 38 = 85 #### 85"
    digits = [a.decode([i]) for i in ids if a.decode([i]).strip().isdigit()]
    assert all(len(d.strip()) == 1 for d in digits) and len(digits) == 8
    assert a.pad_id != a.eos_id


def test_a_stream_started_at_a_position_continues_the_uninterrupted_one():
    """What a restarted sampler relies on: stream(start=k) is the uninterrupted stream from item k on."""
    task = ArithTask(10, 99, 0.1, seed=3)
    whole = [p.prompt_id for p, _ in zip(task.train_stream(1, 2), range(12))]
    assert [p.prompt_id for p, _ in zip(task.train_stream(1, 2, 5), range(7))] == whole[5:]


def test_a_range_whose_every_pair_is_held_out_is_refused_not_drawn_forever():
    """task.min_operand=4 task.max_operand=5 task.heldout_fraction=0.49 passed the config and held out all four
    ordered pairs: train_problem drew forever, and the samplers and the warm start hung saying nothing."""
    for make in (ArithTask, ArithToolsTask):
        with pytest.raises(ValueError, match=r"heldout_fraction=0.49 holds out all 4 operand pairs of "
                                             r"task.min_operand=4..task.max_operand=5.*lower task.heldout_fraction"):
            make(4, 5, 0.49, seed=0)
    task = ArithTask(4, 5, 0.1, seed=0)  # the same range with training pairs left draws them
    assert not task.is_heldout(task.train_problem(0).a, task.train_problem(0).b)


def test_held_out_problems_of_a_wide_operand_range_are_drawn_not_listed(monkeypatch):
    """heldout() listed every ordered operand pair: about 2 minutes at four-digit operands, at every evaluation, and
    never done at task.max_operand's bound (10**12 pairs). A range over LISTED_PAIRS draws distinct held-out pairs, the
    same in every process; narrower ranges keep their listed order (the learning checks were calibrated on it)."""
    from grpo_stream.common.tasks import arith

    listed = [(p.a, p.b) for p in ArithTask(10, 99, 0.1, seed=0).heldout(40)]
    monkeypatch.setattr(arith, "LISTED_PAIRS", 100)  # 10..99 now draws
    drawn = ArithTask(10, 99, 0.1, seed=0).heldout(40)
    pairs = [(p.a, p.b) for p in drawn]
    assert len(set(pairs)) == 40 and pairs != listed and all(ArithTask(10, 99, 0.1, 0).is_heldout(*p) for p in pairs)
    assert [(p.a, p.b) for p in ArithTask(10, 99, 0.1, seed=0).heldout(40)] == pairs  # same in every process
    assert [p.prompt_id for p in drawn] == [f"arith-heldout-{k}" for k in range(40)]
    asked = r"900 held-out problems asked for \(eval.num_problems, or `grpo-stream eval --limit`\), but there are \d+"
    with pytest.raises(ValueError, match=asked):
        ArithTask(10, 99, 0.1, seed=0).heldout(900)  # 8100 pairs, about 810 held out
    monkeypatch.undo()
    widest = ArithTask(0, 10**6, 0.1, seed=0)
    assert (10**6 + 1) ** 2 > arith.LISTED_PAIRS
    assert len({(p.a, p.b) for p in widest.heldout(200) if widest.is_heldout(p.a, p.b)}) == 200
    assert [(p.a, p.b) for p in ArithTask(10, 99, 0.1, seed=0).heldout(40)] == listed
