"""Running multi-turn episodes on a serving engine, with the environment's steps off the decode path.

Each episode is one completion of a group. Its first turn is a request whose prompt is the problem's prompt; when
a turn ends (the model sampled its stop token) the engine frees the slot at once and hands the turn back
(`EpisodeRequests.finish`, on the engine's thread); the environment's step runs on a worker thread while the other
slots keep decoding; its observation is rendered and tokenized once and appended, and the next turn enters the
engine as a request whose prompt is the whole conversation so far, ids exactly as sampled and as rendered. By default
(environment.kv_cache=reprefill) the engine prefills that prompt again: the turn's slot was freed for other work
while the environment answered. With kv_cache=hold the slot keeps the episode's cache while it waits and the next
turn feeds it only the observation (common/engine/held_turns.py); held slots are given up when rows need them.

An episode ends when the environment returns no observation, after environment.max_turns model turns, or when its
tokens (model and observation tokens after the prompt) would pass its budget (generation.max_new_tokens; then it is
truncated). A turn that reaches its own budget (environment.turn_max_new_tokens) without a stop token is answered
like any other (the environment sees what the model wrote); its stop token is written before the observation, as an
observation token, so the chat template's turn structure holds.

In-flight weight updates work across turns: each token records the version that drew it, and an observation token
takes the version of the model token before it (it was written in reply to that turn).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from grpo_stream.common.engine.base import Request
from grpo_stream.common.environments.base import Episode


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int                 # most model turns per episode
    turn_max_new_tokens: int       # most tokens of one model turn
    episode_tokens: int            # most tokens after the prompt, model and observation tokens together
    tool_latency_s: float = 0.0    # added to every environment step (benchmarks: a simulated slow tool)
    hold_kv: bool = False          # keep a waiting episode's cache in its slot (engines that can: held_turns.py)


@dataclasses.dataclass
class EpisodeResult:
    """One finished episode: the completion's tokens after the prompt, as the trainer will see them."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)   # 0 on observation tokens
    model_mask: list[bool] = dataclasses.field(default_factory=list)  # True: sampled by the model
    versions: list[int] = dataclasses.field(default_factory=list)     # per token; empty without in-flight updates
    turn_texts: list[str] = dataclasses.field(default_factory=list)   # each model turn, decoded
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    turn_closed: list[bool] = dataclasses.field(default_factory=list)  # the turn ended with a stop token
    finished: bool = False         # ended by the environment or a stop token (not at a token budget)
    error: str | None = None       # the environment raised: the episode ended there

    @property
    def turns(self) -> int:
        return len(self.turn_texts)

    @property
    def model_text(self) -> str:
        """The model's turns joined: what the run's rewards score."""
        return "\n".join(self.turn_texts)


class EpisodeRequests:
    """The request source of a set of episodes (common/engine/base.py RequestSource). Thread-safe: the engine
    takes and finishes requests on its thread, environment steps run on the pool's."""

    def __init__(self, prompts: list[list[int]], episodes: list[Episode], keys: np.ndarray, settings: EpisodeSettings,
                 tokenizer, renderer, pool: concurrent.futures.Executor, versioned: bool):
        self.prompts, self.episodes, self.keys, self.settings = prompts, episodes, keys, settings
        self.tokenizer, self.renderer, self.pool, self.versioned = tokenizer, renderer, pool, versioned
        self.results = [EpisodeResult() for _ in episodes]
        self._ready: list[Request] = []
        self._released: list[int] = []
        self._outstanding = len(episodes)  # episodes not ended yet
        self._cond = threading.Condition()
        self.env_seconds = 0.0
        for i in range(len(episodes)):
            self._ready.append(self._request(i))

    def _request(self, i: int, observation: list[int] | None = None) -> Request:
        """Episode i's next turn: its prompt is the conversation so far; with settings.hold_kv it also names the
        held cache it continues (`resume`, fed the observation) and asks for its own cache to be held unless it is
        the last turn allowed."""
        result, s = self.results[i], self.settings
        budget = min(s.turn_max_new_tokens, s.episode_tokens - len(result.tokens))
        key = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(self.keys[i]),
                                                                result.turns)))
        request = Request(ids=list(self.prompts[i]) + result.tokens, budget=budget, key=key, tag=i)
        if s.hold_kv:
            request.hold_key = i if result.turns + 1 < s.max_turns else None
            if result.turns:  # the cache held after the last turn (an empty observation: nothing to feed, prefilled)
                request.resume, request.forced = i, list(observation or [])
        return request

    def released(self) -> list[int]:
        """Episodes ended since the last call: their held caches will not be resumed."""
        with self._cond:
            ended, self._released = self._released, []
        return ended

    def take(self) -> list[Request]:
        with self._cond:
            taken, self._ready = self._ready, []
        return taken

    def open(self) -> bool:
        with self._cond:
            return self._outstanding > 0

    def wait(self, timeout: float) -> None:
        with self._cond:
            if not self._ready and self._outstanding > 0:
                self._cond.wait(timeout)

    def finish(self, request: Request, tokens, logprobs, versions, finished: bool) -> None:
        i, result = request.tag, self.results[request.tag]
        result.tokens += np.asarray(tokens).tolist()
        result.logprobs += np.asarray(logprobs, np.float32).tolist()
        result.model_mask += [True] * len(tokens)
        if self.versioned and versions is not None:
            result.versions += np.asarray(versions).tolist()
        stop_ids = set(self.tokenizer.eos_ids)
        text_ids = [t for t in np.asarray(tokens).tolist() if t not in stop_ids]
        result.turn_texts.append(self.tokenizer.decode(text_ids))
        result.turn_closed.append(bool(finished))
        if len(result.tokens) >= self.settings.episode_tokens:  # out of tokens: cut, whatever the turn was doing
            self._end(i, finished=finished and result.turns >= self.settings.max_turns)
        elif result.turns >= self.settings.max_turns:
            self._end(i, finished=True)
        else:  # a turn cut at environment.turn_max_new_tokens is answered too, as verifiers-style environments do
            self.pool.submit(self._step, i)

    def _step(self, i: int) -> None:
        """The environment's answer to episode i's last turn (a pool thread): end it, or queue its next turn. Nothing
        it raises escapes: an episode that is neither ended nor queued would keep `serve` waiting for ever."""
        started = time.monotonic()
        try:
            ids = self._answer(i)
        except Exception as exc:  # noqa: BLE001 - an environment's bug ends its episode, never the sampler
            self.results[i].error = f"{type(exc).__name__}: {exc}"[:500]
            ids = None
        with self._cond:
            self.env_seconds += time.monotonic() - started
        result = self.results[i]
        try:
            if ids is None:
                self._end(i, finished=True)
            elif len(result.tokens) + len(ids) >= self.settings.episode_tokens:
                self._end(i, finished=False)  # no room for the observation and a model token after it
            else:
                self._append_observation(i, ids)
        except Exception as exc:  # noqa: BLE001
            result.error = f"{type(exc).__name__}: {exc}"[:500]
            self._end(i, finished=False)

    def _answer(self, i: int) -> list[int] | None:
        """The ids of the environment's observation after episode i's last turn (None: the episode ends)."""
        result = self.results[i]
        if self.settings.tool_latency_s:
            time.sleep(self.settings.tool_latency_s)
        turn = self.episodes[i].step(result.turn_texts[-1])
        result.turn_rewards.append(float(turn.reward))
        if turn.observation is None:
            return None
        ids = self.renderer.render(turn.observation)
        if not result.turn_closed[-1]:  # the turn was cut: close it as the template does
            ids = self.renderer.end_of_turn_ids() + ids
        return ids

    def _append_observation(self, i: int, ids: list[int]) -> None:
        result = self.results[i]
        result.tokens += ids
        result.logprobs += [0.0] * len(ids)
        result.model_mask += [False] * len(ids)
        if result.versions:
            result.versions += [result.versions[-1]] * len(ids)
        with self._cond:
            self._ready.append(self._request(i, ids))
            self._cond.notify_all()

    def _end(self, i: int, finished: bool) -> None:
        self.results[i].finished = finished and self.results[i].error is None
        with self._cond:
            self._outstanding -= 1
            self._released.append(i)
            self._cond.notify_all()


def run_episodes(engine, params: Any, prompts: list[list[int]], episodes: list[Episode], rng: jax.Array,
                 settings: EpisodeSettings, tokenizer, renderer, pool: concurrent.futures.Executor,
                 greedy: bool = False, refresh: Callable[[], tuple[Any, int] | None] | None = None,
                 version: int = 0) -> tuple[list[EpisodeResult], dict]:
    """Run one episode per prompt (episodes[i] answers prompts[i]'s turns) on a serving engine (`engine.serve`);
    row i samples with fold_in(rng, i), its turn t with fold_in(that, t). Returns the episodes and timing figures."""
    if not hasattr(engine, "serve"):
        raise ValueError(f"environment: sampler.engine {type(engine).__name__} cannot serve multi-turn episodes; "
                         "use sampler.engine=jax or vllm")
    if not prompts:
        return [], {"episodes": 0}
    keys = np.asarray(jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(rng, i))(np.arange(len(prompts)))))
    source = EpisodeRequests(prompts, episodes, keys, settings, tokenizer, renderer, pool,
                             versioned=refresh is not None)
    started = time.monotonic()
    engine.serve(params, source, greedy=greedy, refresh=refresh, version=version)
    return source.results, {"episodes": len(prompts), "seconds": time.monotonic() - started,
                            "environment_seconds": source.env_seconds,
                            "turns": sum(r.turns for r in source.results)}
