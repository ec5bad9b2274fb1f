"""The verifiers task's held-out split: an environment without an eval dataset gives its last tenth to evaluation,
and the run never trains on it (its eval curve would score trained prompts)."""

import itertools
import pathlib
import types

import pytest

from grpo_stream.common.tasks.verifiers_task import VerifiersTask, load_environment

ENVS = pathlib.Path(__file__).resolve().parents[3] / "verifiers_envs"


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


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from grpo_stream.common.model.tokenizer import HFTokenizer  # noqa: PLC0415 - needs transformers
    from tests.chat_families import build_tokenizer  # noqa: PLC0415 - needs tokenizers

    return HFTokenizer(build_tokenizer(tmp_path_factory.mktemp("qwen"), "qwen", "qwen2"))


class Rows:
    """An environment whose dataset rows have the given prompts."""

    eval_dataset = None

    def __init__(self, *prompts):
        self.prompts = prompts

    def get_dataset(self):
        return [{"prompt": prompt, "answer": "4", "example_id": i} for i, prompt in enumerate(self.prompts)]


def test_text_parts_in_a_verifiers_dataset_render_as_the_endpoint_renders_them(qwen_tokenizer):
    """A verifiers dataset whose prompt contents are OpenAI text parts ([{"type": "text", ...}]) stopped the task's
    build on Qwen's template (it concatenates content to a string: TypeError), though the endpoint, which joins
    the parts, answers such a prompt; each row's prompt is now the text the endpoint renders for its first turn."""
    vf = pytest.importorskip("verifiers")
    datasets = pytest.importorskip("datasets")
    from grpo_stream.common.endpoint.chat import template_messages  # noqa: PLC0415 - the endpoint's own rendering

    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    env = vf.SingleTurnEnv(dataset=datasets.Dataset.from_list([{"prompt": parts, "answer": "4"}] * 3),
                           rubric=vf.Rubric(funcs=[lambda **kwargs: 1.0]))
    called = [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Add 2 and 2."},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                  "name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
              {"role": "tool", "content": [{"type": "text", "text": "4"}], "tool_call_id": "c1"},
              {"role": "user", "content": "And now?"}]
    rendered = []
    for environment in (env, Rows(called)):
        row = dict(environment.get_dataset()[0])
        endpoint = qwen_tokenizer.render_chat(template_messages(row["prompt"]), add_generation_prompt=True)
        rendered.append(VerifiersTask(environment, qwen_tokenizer, "env", seed=0, eval_split=False).train[0].prompt)
        assert rendered[-1] == endpoint
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered[0]
    # 'developer' is the system turn, a demonstrated call's arguments an object, a tool's text parts its result
    assert "<|im_start|>system\nUse tools." in rendered[1] and '"arguments": {"a": 2, "b": 2}' in rendered[1]
    assert "<tool_response>\n4\n</tool_response>" in rendered[1]


def test_a_prompt_with_an_image_part_is_refused_naming_the_row(qwen_tokenizer):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(ValueError, match=r"environment=env: row 1's prompt\[0\]\.content: a string or a list of text"):
        VerifiersTask(Rows([{"role": "user", "content": "q"}], image), qwen_tokenizer, "env", 0, eval_split=False)


def test_an_environment_missing_a_dependency_is_refused_naming_the_setting_and_the_dependency(tmp_path, monkeypatch):
    """verifiers wraps the ImportError in "ensure the package for the environment is installed", also when it is and
    one of its own imports is missing: the message names the setting and the module that is missing."""
    pytest.importorskip("verifiers")
    (tmp_path / "grpo_test_needs_dep.py").write_text("import grpo_no_such_dependency\n\n"
                                                     "def load_environment():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = types.SimpleNamespace(environment="grpo-test-needs-dep", args={})
    with pytest.raises(ValueError, match=r"task\.verifiers\.environment='grpo-test-needs-dep': cannot import it: "
                                         r"No module named 'grpo_no_such_dependency'"):
        load_environment(settings)


def test_an_environment_refusing_its_arguments_is_refused_naming_the_setting_and_the_cause(monkeypatch):
    pytest.importorskip("verifiers")
    monkeypatch.syspath_prepend(str(ENVS))
    settings = types.SimpleNamespace(environment="grpo-test-arith", args={"kind": "bogus"})
    with pytest.raises(ValueError, match=r"task\.verifiers\.environment='grpo-test-arith': its load_environment "
                                         r"\(task\.verifiers\.args given: kind\) raised ValueError: kind='bogus'"):
        load_environment(settings)


def test_a_numeric_answer_of_zero_is_the_rows_reference():
    """A dataset whose answer column holds numbers (0 among them): `str(answer or "")` made 0 no reference, so the
    evaluation's accuracy (answer_correct against it) was 0 on that row whatever the model answered."""
    from grpo_stream.common.tasks.rewards import answer_correct  # noqa: PLC0415 - this test's check

    class Numeric(Environment):
        def get_dataset(self):
            return [{"prompt": [{"role": "user", "content": f"{i} - {i}?"}], "answer": answer}
                    for i, answer in enumerate((0, 0.0, 7, None))]

    task = VerifiersTask(Numeric(0), Tokenizer(), "env", seed=0, eval_split=False)
    answers = [p.answer for p in task.train + task.test]
    assert answers == ["0", "0.0", "7", ""]
    assert answer_correct("#### 0", task.train[0].answer) == 1.0
