"""A tool call has a bounded time: a user-defined in-process tool that hangs held its worker, its episode and its
group for ever (environment.turn_tool_seconds was checked only between calls). Now the call is given up at the
turn's deadline (and logged), and the model reads an error naming the setting."""

import threading

from grpo_stream.common.environments.tool_episode import ToolEpisode, TurnLimits
from grpo_stream.common.tools.calls import ToolCall, render_tool_calls
from grpo_stream.common.tools.functions import ToolSet
from tests.support import wait_for


def test_a_hung_tool_is_given_up_at_the_turns_deadline():
    released = threading.Event()

    def stuck(x: int) -> int:
        """A tool that never answers until the test ends."""
        released.wait()
        return x

    def add(a: int, b: int) -> int:
        """Adds."""
        return a + b

    episode = ToolEpisode(ToolSet([stuck, add]), "qwen", limits=TurnLimits(max_calls=8, seconds=0.2))
    text = render_tool_calls([ToolCall("stuck", {"x": 1}), ToolCall("add", {"a": 1, "b": 2})], "qwen")
    answers = []
    stepping = threading.Thread(target=lambda: answers.append(episode.step(text)), daemon=True)
    try:
        stepping.start()
        # the hang guard of the test itself, far past the turn's 0.2 s: without a deadline the step never returns
        wait_for(lambda: answers, 30, "the step of a turn whose tool hangs to return")
    finally:
        released.set()
    stuck_answer, add_answer = answers[0].observation.parts
    assert stuck_answer.startswith("error: tool 'stuck' did not answer within") and \
        "environment.turn_tool_seconds" in stuck_answer, stuck_answer
    assert "environment.turn_tool_seconds" in add_answer and "not run" in add_answer, add_answer


def test_calls_within_the_deadline_answer_as_before():

    def add(a: int, b: int) -> int:
        """Adds."""
        return a + b

    episode = ToolEpisode(ToolSet([add]), "plain")
    assert episode.step("<call>add(2, 3)</call> <call>add(b=1)</call>").observation.parts == (
        "5", "error: tool 'add' needs argument 'a' (an integer); its arguments: a (an integer), b (an integer)")
