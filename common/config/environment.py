"""The environment section: multi-turn episodes with tools (common/environments)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_stream.common.config.base import Strict
from grpo_stream.common.config.names import EnvironmentName


class PythonToolSection(Strict):
    cpu_seconds: float = Field(2.0, gt=0, le=600, description="CPU seconds one call of the Python tool may use.")
    wall_seconds: float = Field(5.0, gt=0, le=600, description="Wall-clock seconds one call may take before its "
                                "processes are killed.")
    memory_mb: int = Field(256, ge=32, le=65536, description="Address space of the tool's process, in MiB.")
    output_bytes: int = Field(8192, ge=64, le=1 << 20, description="Bytes of its output the model sees (the rest "
                              "is cut).")
    disk_mb: int = Field(64, ge=1, le=65536, description="As root with CAP_SYS_ADMIN: all a call may write, in MiB "
                         "(its working directory is a tmpfs of this size in a mount namespace of its own, gone when "
                         "it ends). Without it the working directory is read-only to the code.")
    max_files: int = Field(1024, ge=16, le=1 << 20, description="As root with CAP_SYS_ADMIN: files and directories a "
                           "call may create (the tmpfs's inodes).")
    allow_unconfined: bool = Field(False, description="Where the kernel has no Landlock, run the tool with resource "
                                   "limits only (it could then read the sampler's files). Off: the tool refuses to "
                                   "run there.")


class EnvironmentSection(Strict):
    name: EnvironmentName = Field(None, description="Null: single-turn tasks (a prompt, G completions, rewards). "
                                  "Else a multi-turn environment of common/registry/environments.py: 'arith_tools' "
                                  "(the CPU demo: an addition game with a calculator tool), 'gsm8k_tools' (GSM8K "
                                  "with a calculator and a Python tool).")
    max_turns: int = Field(4, ge=1, le=256, description="Most model turns in one episode.")
    turn_max_new_tokens: int | None = Field(None, ge=1, le=32768, description="Most tokens of one model turn. Null: "
                                            "generation.max_new_tokens. The whole episode after the prompt (model "
                                            "and observation tokens) is bounded by generation.max_new_tokens.")
    tool_format: Literal["plain", "qwen", "llama3", "gemma"] | None = Field(
        None, description="How tool calls are written in the model's turns: the chat template family's format "
        "('qwen': <tool_call>{json}</tool_call>, Hermes-style; 'llama3': a JSON object; 'gemma': ```tool_code``` python "
        "calls; 'plain': <call>f(...)</call>, the tiny model's). Null: inferred from the chat template's tool markup "
        "and config.json's model_type ('qwen' for a template with none of a known family; 'plain' for the tiny "
        "model), said in the log. A template that does not write tools or tool calls itself gets them written in "
        "this format (docs/tools.md).")
    kv_cache: Literal["reprefill", "hold"] = Field(
        "reprefill", description="Between an episode's turns: 'reprefill' frees its decode slot while the environment "
        "answers and prefills the conversation again for the next turn; 'hold' keeps the slot and its cache and feeds "
        "it only the observation (sampler.engine=jax; held slots are given up when other rows need them).")
    workers: int = Field(16, ge=1, le=1024, description="Threads running environment steps (tool calls) while the "
                         "engine decodes other episodes.")
    max_calls_per_turn: int = Field(8, ge=1, le=1024, description="Tool calls run for one model turn; the calls "
                                    "past it are answered with an error naming this setting, not run.")
    turn_tool_seconds: float = Field(30.0, gt=0, le=86_400, description="Wall time the tool calls of one model turn "
                                     "may take together; a call still running then is given up and the remaining "
                                     "ones are not run, each answered with an error (each python call also has its "
                                     "own limit: python_tool.wall_seconds). An environment's whole step may take this "
                                     "plus 30 s; one still running then ends its episode with an error.")
    turn_reward_weight: float = Field(1.0, ge=0, le=1000, description="Weight of the sum of an episode's per-turn "
                                      "rewards, added to its task.rewards total.")
    tool_latency_s: float = Field(0.0, ge=0, le=600, description="Seconds added to every environment step (a "
                                  "simulated slow tool; `bench multiturn`).")
    python_tool: PythonToolSection = Field(default_factory=PythonToolSection, description="Limits of the Python "
                                           "tool (gsm8k_tools).")
