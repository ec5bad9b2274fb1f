"""The verifiers task's held-out split: an environment without an eval dataset gives its last tenth to evaluation,
and the run never trains on it (its eval curve would score trained prompts)."""

import itertools

import pytest

from grpo_stream.common.tasks.verifiers_task import VerifiersTask


class Tokenizer:
    def render_chat(self, messages, add_generation_prompt, tools=None):
        return messages[0]["content"]


class LastMessage:
    """A chat template that renders the last message only (a verifiers prompt starts with its system message)."""

    def render_chat(self, messages, add_generation_prompt, tools=None):
        return messages[-1]["content"]


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


def test_an_eval_dataset_given_as_a_builder_is_the_held_out_split():
    """verifiers builds a dataset given as a builder (a callable) only when asked: `env.eval_dataset` stays None
    until then, which the task took for no eval dataset, holding out training rows and evaluating on them."""
    vf = pytest.importorskip("verifiers")
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_list([{"question": f"train {i}", "answer": str(i)} for i in range(20)])
    env = vf.SingleTurnEnv(dataset=train, rubric=vf.Rubric(funcs=[lambda **kwargs: 1.0]), eval_dataset=lambda:
                           datasets.Dataset.from_list([{"question": f"held {i}", "answer": str(i)} for i in range(3)]))
    task = VerifiersTask(env, LastMessage(), "env", seed=0, eval_split=True)
    assert [p.prompt for p in task.heldout(5)] == ["held 0", "held 1", "held 2"]
    assert len(task.train) == 20  # every training row is trained on
    assert [p.prompt for p in VerifiersTask(env, LastMessage(), "env", 0, eval_split=False).heldout(5)] == [
        "train 18", "train 19"]  # eval_split=false: the last tenth, as before
