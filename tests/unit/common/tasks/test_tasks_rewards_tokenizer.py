from grpo_stream.common.tasks.answers import extract_answer
from grpo_stream.common.tasks.rewards import answer_correct, score
from grpo_stream.common.tasks.arith import ArithTask
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
