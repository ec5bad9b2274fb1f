"""A run's multi-turn setup, built the same way in a sampler and in the trainer's evaluation: the environment, the
observation renderer, the settings and the worker pool its steps run on."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable

import jax

from grpo_stream.common.environments.episodes import EpisodeResult, EpisodeSettings, run_episodes
from grpo_stream.common.environments.registry import build_environment
from grpo_stream.common.environments.render import renderer_for


@dataclasses.dataclass
class EpisodeRunner:
    environment: Any
    renderer: Any
    settings: EpisodeSettings
    tokenizer: Any
    pool: concurrent.futures.ThreadPoolExecutor

    def run(self, engine, params, problems: list, prompts: list[list[int]], rng: jax.Array, greedy: bool = False,
            refresh: Callable | None = None, version: int = 0) -> tuple[list[EpisodeResult], dict]:
        """One episode per (problem, prompt ids) row."""
        episodes = [self.environment.start(p) for p in problems]
        return run_episodes(engine, params, prompts, episodes, rng, self.settings, self.tokenizer, self.renderer,
                            self.pool, greedy=greedy, refresh=refresh, version=version)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def episode_runner(cfg, task, tokenizer) -> EpisodeRunner | None:
    """The run's episode runner, or None for single-turn tasks (environment.name unset)."""
    env = cfg.environment
    if env.name is None:
        return None
    gen = cfg.generation
    settings = EpisodeSettings(max_turns=env.max_turns, turn_max_new_tokens=env.turn_max_new_tokens or gen.max_new_tokens,
                               episode_tokens=gen.max_new_tokens, tool_latency_s=env.tool_latency_s,
                               hold_kv=env.kv_cache == "hold")
    pool = concurrent.futures.ThreadPoolExecutor(env.workers, thread_name_prefix="environment")
    return EpisodeRunner(build_environment(cfg, task, tokenizer), renderer_for(tokenizer), settings, tokenizer, pool)
