"""Multi-turn rollouts with an environment (environment.name): model turns, and between them the environment's
observations (tool results, replies), with the environment's steps off the decode path.

Each episode is one row of its group. Its first turn is a request whose prompt is the problem's prompt; when a turn
ends (the model sampled its stop token, or its budget ran out) the engine frees the slot at once and hands the turn
back on its thread (`turn_done`: bookkeeping only); the rest runs on a worker of the pool (environment.workers): the
turn's text is decoded, the environment's step runs, its observation is rendered and tokenized once and appended,
and the next turn enters the stream as a request whose prompt is the whole conversation so far, ids exactly as
sampled and as rendered. By default (environment.kv_cache=reprefill) the engine prefills that prompt again: the
turn's slot went to other work while the environment answered. With kv_cache=hold the slot keeps the episode's cache
while it waits and the next turn feeds it only the observation (common/engine/held_turns.py).

An episode ends when the environment returns no observation, after environment.max_turns model turns (the
environment still answers the last one, for its turn reward; an episode it would go on with is truncated), or when
its tokens (model and observation tokens after the prompt) would pass its budget (generation.max_new_tokens; then it
is truncated). A turn that reaches its own budget (environment.turn_max_new_tokens) without a stop token is answered
like any other (the environment sees what the model wrote); its stop token is written before the observation, as an
observation token, so the chat template's turn structure holds. An episode whose final turn was so cut is truncated,
whether the environment or max_turns ended it. An environment that raises, or answers a turn with
a reward that is not a finite number, ends its episode there (the error is kept on the episode); nothing it does
escapes into the stream.

Versions: each model token records the version that drew it, an observation token the version of the model token
before it (it was written in reply to that turn).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
from typing import Any, Callable

from grpo_stream.common.engine.base import Request
from grpo_stream.common.environments.registry import build_environment
from grpo_stream.common.environments.render import renderer_for
from grpo_stream.common.episodes.result import EpisodeResult
from grpo_stream.common.episodes.stream import GroupRun
from grpo_stream.common.runtime.given_up import GivenUp, TooManyGivenUp, call_within

# past environment.turn_tool_seconds (what a turn's tool calls may take together), what an environment's step may take
# besides them (parsing, a simulated user's reply) before it is given up
STEP_MARGIN_S = 30.0
# more characters than any token of a tokenizer's vocabulary spells (its longest: runs of spaces or of '=', tens of
# characters): an observation of more than this many characters a token left is longer than the episode's room
MAX_CHARS_PER_TOKEN = 256
NO_ROOM: list[int] = []  # `_answer`'s answer (compared by identity) for an observation the episode has no room for


class StepTimedOut(Exception):
    """An environment's step did not answer within its bound (EpisodeSettings.step_seconds)."""


def bounded(call: Callable[[], Any], seconds: float | None, what: str):
    """`call()`, or StepTimedOut once `seconds` pass: an environment's `what` (its step, its start) that hangs (a
    user-written environment's) held its worker, its episode and its group for ever (a start: the sampler's feeder).
    Given up, not stopped (common/runtime/given_up.py). What it raises is raised here."""
    if seconds is None:
        return call()
    try:
        return call_within(call, seconds, f"{threading.current_thread().name}-{what}")
    except GivenUp:
        raise StepTimedOut(f"the environment's {what} did not answer within {seconds:g} s (environment."
                           f"turn_tool_seconds + {STEP_MARGIN_S:g} s); it was given up") from None


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int                 # most model turns per episode
    turn_max_new_tokens: int       # most tokens of one model turn
    episode_tokens: int            # most tokens after the prompt, model and observation tokens together
    tool_latency_s: float = 0.0    # added to every environment step (benchmarks: a simulated slow tool)
    hold_kv: bool = False          # keep a waiting episode's cache in its slot (engines that can: held_turns.py)
    step_seconds: float | None = None  # most wall time of one environment step (None: unbounded); `build` derives it


class _Episode:
    """One row's episode: the environment's episode, its result so far, and its turns' requests."""

    def __init__(self, kind: "ToolTurns", run: GroupRun, row: int, env_episode):
        self.kind, self.run, self.row, self.env_episode = kind, run, row, env_episode
        self.result = EpisodeResult()
        self.hold_key = run.stream.hold_key() if kind.settings.hold_kv else None
        self._turn_ids: list[int] = []

    def next_turn(self, observation: list[int] | None = None) -> None:
        """Submit the episode's next turn: its prompt is the conversation so far; with settings.hold_kv it also
        names the held cache it continues (`resume`, fed the observation) and asks for its own cache to be held
        unless it is the last turn allowed."""
        result, s, work = self.result, self.kind.settings, self.run.work
        budget = min(s.turn_max_new_tokens, s.episode_tokens - len(result.tokens))
        request = Request(ids=list(work.prompt_ids) + result.tokens, budget=budget,
                          key=self.run.key(self.row, result.turns), tag=self, greedy=work.greedy)
        if s.hold_kv:
            request.hold_key = self.hold_key if result.turns + 1 < s.max_turns else None
            if result.turns:  # the cache held after the last turn (an empty observation: nothing to feed, prefilled)
                request.resume, request.forced = self.hold_key, list(observation or [])
        self.run.stream.submit(request)

    def turn_done(self, request: Request, tokens, logprobs, versions, finished: bool) -> None:
        """The engine's thread: record the turn, then let a worker decide what follows."""
        self.result.add_turn(tokens, logprobs, versions, finished)
        self._turn_ids = self.result.tokens[len(self.result.tokens) - len(tokens):]
        self.kind.pool.submit(self._after_turn)

    def _after_turn(self) -> None:
        """A worker: decode the turn, end the episode or answer it. Nothing escapes: an episode neither ended nor
        continued would keep its group in flight for ever."""
        result, s = self.result, self.kind.settings
        try:
            stops = set(self.kind.tokenizer.eos_ids)
            result.turn_texts.append(self.kind.tokenizer.decode([t for t in self._turn_ids if t not in stops]))
            if len(result.tokens) >= s.episode_tokens and not result.turn_closed[-1]:
                self._end(finished=False)  # cut mid-turn by the episode's budget
            elif result.turns >= s.max_turns:
                self._last_step()
            else:  # a turn cut at environment.turn_max_new_tokens is answered too, as verifiers-style ones are; one
                self._step()  # closed on the budget's last token too: the environment may end it (else truncated)
        except BaseException as exc:  # noqa: BLE001 - a bug here ends this episode, never the sampler (a worker
            # thread: no interrupt to pass on; a SystemExit left in the future would leave the episode hanging)
            result.error = result.error or f"{type(exc).__name__}: {exc}"[:500]
            self.kind.note_fatal(exc)
            self._end(finished=False)

    def _environment(self, call):
        """`call()`, its time counted as the environment's; an environment's bug is kept on the episode (which then
        ends unfinished: `_end`) and gives None. BaseException: a SystemExit (model-written code calling exit() in an
        in-process tool) that escaped the worker's future left the episode neither ended nor continued, and its group
        in flight for ever."""
        started = time.monotonic()
        try:
            return call()
        except BaseException as exc:  # noqa: BLE001 - an environment's bug ends its episode, never the sampler
            self.result.error = f"{type(exc).__name__}: {exc}"[:500]
            self.kind.note_fatal(exc)
            return None
        finally:
            self.kind.add_environment_seconds(time.monotonic() - started)

    def _step(self) -> None:
        ids = self._environment(self._answer)
        if ids is None:
            # ended by the environment: an answer cut at turn_max_new_tokens is still cut (truncated, as at max_turns;
            # it was counted finished, and algo.overlong never saw it)
            self._end(finished=self.result.turn_closed[-1])
        elif ids is NO_ROOM or len(self.result.tokens) + len(ids) >= self.kind.settings.episode_tokens:
            self._end(finished=False)  # no room for the observation and a model token after it
        else:
            self.result.add_observation(ids)
            self.next_turn(ids)

    def _last_step(self) -> None:
        """At environment.max_turns the environment still answers the last turn, for its turn reward (one graded
        there was lost), and an episode it would go on with is truncated: that turn is a tool call, not an answer
        (scored as one, code printing `#### 75` read as the answer). Finished only if the turn was closed too."""
        turn = self._environment(self._environment_turn)
        self._end(finished=self.result.turn_closed[-1] and turn is not None and turn.observation is None)

    def _answer(self) -> list[int] | None:
        """The ids of the environment's observation after the last turn (None: the episode ends; NO_ROOM: it is far
        past the episode's budget)."""
        result = self.result
        turn = self._environment_turn()
        if turn.observation is None:
            return None
        room = self.kind.settings.episode_tokens - len(result.tokens)
        observation = turn.observation
        # an observation far longer than the tokens left cannot fit: not tokenized (a tool's output of unbounded
        # size, a whole file, took a worker and the memory to tokenize it, only for the episode to end at its budget)
        if max(len(observation.content), sum(map(len, observation.parts))) > room * MAX_CHARS_PER_TOKEN:
            return NO_ROOM
        ids = self.kind.renderer.render(observation)
        if not result.turn_closed[-1]:  # the turn was cut: close it as the template does
            ids = self.kind.renderer.end_of_turn_ids() + ids
        return ids

    def _environment_turn(self):
        """The environment's Turn for the last model turn, its reward recorded."""
        result = self.result
        if self.kind.settings.tool_latency_s:
            time.sleep(self.kind.settings.tool_latency_s)
        turn = bounded(lambda: self.env_episode.step(result.turn_texts[-1]), self.kind.settings.step_seconds, "step")
        reward = float(turn.reward)
        # a NaN or infinite turn reward makes the episode's reward NaN at any weight (0 x NaN), and the ingest then
        # refuses the whole group: an environment's bug, which ends its episode as a raise does
        if not math.isfinite(reward):
            raise ValueError(f"the environment's turn reward is {reward}; a turn reward must be a finite number")
        result.turn_rewards.append(reward)
        return turn

    def _end(self, finished: bool) -> None:
        self.result.finished = finished and self.result.error is None
        if self.hold_key is not None:
            self.run.stream.release(self.hold_key)
        self.run.episode_done(self.row, self.result)


class ToolTurns:
    """The rollout kind of environments: `environment` (common/environments/base.py) starts each row's episode,
    `renderer` writes observations in the model's chat template, steps run on `workers` threads."""

    def __init__(self, environment, renderer, settings: EpisodeSettings, tokenizer, workers: int):
        self.environment, self.renderer, self.settings, self.tokenizer = environment, renderer, settings, tokenizer
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="environment")
        self.environment_seconds = 0.0  # environment steps (tool calls), summed over the workers
        self._lock = threading.Lock()
        self._fatal: TooManyGivenUp | None = None  # see note_fatal

    def note_fatal(self, exc: BaseException) -> None:
        """Keep what only a new process cures: too many hung calls given up on (common/runtime/given_up.py). Every
        later step would fail its episode while the sampler ran on, its heartbeat telling `up` all was well; the next
        group's start raises it on the feeder's thread instead, which stops the sampler for `up` to restart."""
        if isinstance(exc, TooManyGivenUp):
            with self._lock:
                self._fatal = self._fatal or exc

    def start(self, run: GroupRun) -> None:
        """Start every row's episode. An environment whose `start` raises (a problem it cannot set up) fails the
        whole group, nothing decoded: raised here, on the feeder's thread, it stopped the sampler with the group's
        rows held, and a restarted sampler met the same problem at the same data position again. Raises what
        `note_fatal` kept, before anything starts."""
        if self._fatal is not None:
            raise self._fatal
        episodes = []
        for row in range(run.work.rows):
            try:
                episode = bounded(lambda: self.environment.start(run.work.problem), self.settings.step_seconds, "start")
                episodes.append(_Episode(self, run, row, episode))
            except TooManyGivenUp:
                raise
            except Exception as exc:  # noqa: BLE001 - an environment's bug fails its group, never the sampler
                why = f"the environment's start raised {type(exc).__name__}: {exc}"[:500]
                for failed_row in range(run.work.rows):
                    run.episode_done(failed_row, EpisodeResult(failed=why))
                return
        for episode in episodes:
            episode.next_turn()

    def add_environment_seconds(self, seconds: float) -> None:
        with self._lock:
            self.environment_seconds += seconds

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def build(cfg, task, tokenizer, routes=None) -> ToolTurns:
    """The rollout registry's entry (environment): the run's environment, renderer and settings."""
    env, gen = cfg.environment, cfg.generation
    settings = EpisodeSettings(max_turns=env.max_turns,
                               turn_max_new_tokens=env.turn_max_new_tokens or gen.max_new_tokens,
                               episode_tokens=gen.max_new_tokens, tool_latency_s=env.tool_latency_s,
                               hold_kv=env.kv_cache == "hold", step_seconds=env.turn_tool_seconds + STEP_MARGIN_S)
    return ToolTurns(build_environment(cfg, task, tokenizer), renderer_for(tokenizer), settings, tokenizer, env.workers)
