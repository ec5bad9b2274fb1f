"""The verifiers task's held-out split: an environment without an eval dataset gives its last tenth to evaluation,
and the run never trains on it (its eval curve would score trained prompts)."""

import itertools

from grpo_stream.common.tasks.verifiers_task import VerifiersTask


class Tokenizer:
    def render_chat(self, messages, add_generation_prompt, tools=None):
        return messages[0]["content"]


class Environment:
    """A verifiers environment's dataset interface, `rows` rows, no eval dataset."""

    eval_dataset = None

    def __init__(self, rows: int):
        self.rows = rows

    def get_dataset(self):
        return [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "example_id": i}
                for i in range(self.rows)]


def test_without_an_eval_dataset_the_held_out_tenth_is_never_trained_on():
    task = VerifiersTask(Environment(40), Tokenizer(), "env", seed=0, eval_split=True)
    held = {p.prompt_id for p in task.heldout(100)}
    trained = {p.prompt_id for p in itertools.islice(task.train_stream(0, 1, 0), 200)}  # five epochs
    assert held == {"env/36", "env/37", "env/38", "env/39"}
    assert trained == {f"env/{i}" for i in range(36)}
    assert {p.prompt_id for p in task.split_problems("test", 100)} == held


def test_a_one_row_dataset_evaluates_its_row():
    task = VerifiersTask(Environment(1), Tokenizer(), "env", seed=0, eval_split=False)
    assert [p.prompt_id for p in task.heldout(5)] == ["env/0"] == [p.prompt_id for p in task.train]
