"""task.name=verifiers: a `verifiers` environment as a run's task (docs/verifiers.md).

The environment is loaded as its authors wrote it, `verifiers.load_environment(id, **args)` (task.verifiers), and
stays the package's own object: its dataset gives the problems, its rollouts (single- or multi-turn, with tools)
call the sampler's OpenAI-compatible endpoint, and its rubric scores them (common/episodes/verifiers.py).
This module only makes its dataset rows into the run's problems: each row keeps the environment's own columns
(prompt messages, answer, info, task) for its rollouts, and a rendering of its first prompt by the model's chat
template, which the sampler uses to skip prompts over generation.max_prompt_tokens before calling the environment.

verifiers' Environment installs SIGINT/SIGTERM handlers of its own when it is built (and can only be built on the
main thread because of that); the run keeps its own: the environment is built with `signal.signal` held back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
from typing import Any, Iterator

from grpo_stream.common.model.chat_messages import template_messages
from grpo_stream.common.tasks import prompts
from grpo_stream.common.tasks.streams import shuffled_shard

log = logging.getLogger(__name__)
_SIGNALS = threading.Lock()


@dataclasses.dataclass(frozen=True)
class VerifiersProblem:
    prompt_id: str       # "<environment>/<example_id>"
    prompt: str          # the row's prompt messages rendered by the chat template (with the environment's tools)
    answer: str          # the row's answer column ("" when it has none)
    row: dict[str, Any]  # the dataset row as the environment made it: what its rollouts start from


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """Calls to signal.signal are ignored while the block runs (the run's own handlers stay installed)."""
    with _SIGNALS:
        original = signal.signal
        signal.signal = lambda signum, handler: signal.getsignal(signum)
        try:
            yield
        finally:
            signal.signal = original


def load_environment(settings) -> Any:
    """The environment task.verifiers names, built by the `verifiers` package."""
    try:
        import verifiers as vf  # noqa: PLC0415 - deferred: the `verifiers` extra, for this task only
    except ImportError as exc:
        raise ValueError("task.name=verifiers needs the verifiers package: pip install 'grpo-stream[verifiers]' "
                         f"({exc})") from None
    with _signals_kept():
        try:
            return vf.load_environment(settings.environment, **settings.args)
        except Exception as exc:  # noqa: BLE001 - re-raised below, naming the setting and the cause
            raise ValueError(_load_failure(settings, exc)) from exc


def _load_failure(settings, exc: Exception) -> str:
    """Why task.verifiers' environment did not load. verifiers wraps every failure (an ImportError in a ValueError
    that says "ensure the package is installed" also when the package is, and lacks one of its own dependencies;
    anything else, a wrong argument included, in a RuntimeError): the cause it chained is what names the fix."""
    name = f"task.verifiers.environment={settings.environment!r}"
    cause = exc.__cause__ or exc
    if isinstance(cause, ImportError):
        return (f"{name}: cannot import it: {cause}; install the environment's package and its dependencies, "
                "or put its module on PYTHONPATH")
    given = ", ".join(sorted(settings.args)) or "none"  # names only: an argument may be a judge's key
    return (f"{name}: its load_environment (task.verifiers.args given: {given}) raised {type(cause).__name__}: "
            f"{cause}; fix those arguments or the environment")


def _eval_dataset(env) -> Any:
    """The environment's eval dataset, or None when it has none. An environment may give it as a builder
    (verifiers' DatasetBuilder), which leaves `env.eval_dataset` None until built: build it here, rather than taking
    the unset attribute for no eval dataset (and holding out training rows instead). Not `get_eval_dataset()`,
    which answers an environment without one with its training dataset."""
    build = getattr(env, "build_eval_dataset", None)
    return build() if callable(build) else getattr(env, "eval_dataset", None)


class VerifiersTask:
    """A verifiers environment's dataset as the run's problems (common/tasks/base.py Task)."""

    def __init__(self, env, tokenizer, name: str, seed: int, eval_split: bool):
        self.env, self.tokenizer, self.name, self.seed = env, tokenizer, name, seed
        self.tools = getattr(env, "oai_tools", None) or None
        self.train = self._problems(env.get_dataset())
        if not self.train:
            raise ValueError(f"task.verifiers.environment={name!r}: its dataset has no rows")
        evaluation = _eval_dataset(env) if eval_split else None
        if evaluation is not None:
            self.test = self._problems(evaluation)
        elif len(self.train) >= 2:  # no eval dataset: the last tenth is held out, and so never trained on
            held = max(1, len(self.train) // 10)
            self.train, self.test = self.train[:-held], self.train[-held:]
        else:
            log.warning("task.verifiers.environment=%s: one row and no eval dataset, so nothing is held out: its "
                        "evaluation scores the row it trains on", name)
            self.test = self.train

    def _problems(self, dataset) -> list[VerifiersProblem]:
        problems = []
        for i, row in enumerate(dataset):
            row = dict(row)
            # as the endpoint renders the same messages: text parts joined, developer as system, tool calls kept
            messages = template_messages(row["prompt"], f"task.verifiers.environment={self.name}: row {i}'s prompt")
            text = self.tokenizer.render_chat(messages, add_generation_prompt=True, tools=self.tools)
            answer = row.get("answer")  # a number column's 0 is an answer (`or ""` made it none: accuracy 0 on it)
            problems.append(VerifiersProblem(f"{self.name}/{row.get('example_id', i)}", text,
                                             "" if answer is None else str(answer), row))
        return problems

    def render_question(self, question: str) -> str:
        """An injected question as a user turn (injected prompts are answered by the engine and task.rewards, not by
        the environment: they have no row of its dataset)."""
        return prompts.render(question, "chat", self.tokenizer)

    def train_stream(self, index: int, count: int, start: int = 0) -> Iterator[VerifiersProblem]:
        return shuffled_shard(self.train, index, count, self.seed, start, f"task.verifiers.environment={self.name}")

    def heldout(self, n: int) -> list[VerifiersProblem]:
        return self.test[:n]

    def split_problems(self, split: str, limit: int) -> list[VerifiersProblem]:
        if split not in ("train", "test"):
            raise ValueError(f"--split {split}: a verifiers environment has 'train' (its dataset) and 'test' (its "
                             "eval dataset)")
        return (self.train if split == "train" else self.test)[:limit]


def build(cfg, hf_tokenizer):
    """The task registry's entry (task.name=verifiers)."""
    if hf_tokenizer is None or not hf_tokenizer.has_chat_template:
        raise ValueError("task.name=verifiers: verifiers environments speak chat; use model.kind=hf with a "
                         "checkpoint whose tokenizer has a chat template")
    settings = cfg.task.verifiers
    env = load_environment(settings)
    return VerifiersTask(env, hf_tokenizer, settings.environment, cfg.run.seed, settings.eval_split), hf_tokenizer
