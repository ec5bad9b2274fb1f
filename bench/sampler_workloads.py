"""The workloads of `bench sampler` and the engines it times on them: the continuous JAX engine, the static JAX
engine it replaced, Hugging Face `generate`, and vLLM (in its own environment, bench/vllm_decode.py).

A workload is a request set: rows of (prompt token ids, completion budget). The model's EOS is disabled (an id
no engine can draw), so every row generates exactly its budget on every engine, and `useful tokens` (tokens up
to and including EOS, or up to the budget) is the sum of the budgets. Each engine reports useful tokens per
second of wall time and the cores it kept busy (process CPU seconds over wall seconds).
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import statistics
import subprocess
import tempfile
import time

import jax
import numpy as np

NO_EOS = -1  # an id no sampler can draw, so every row runs to its budget on every engine


def longtail_budgets(rows: int, max_new_tokens: int, median: float, sigma: float, seed: int) -> list[int]:
    """Completion lengths with a GSM8K-like long tail: log-normal around `median`, clipped to 4..max_new_tokens
    (with median = max/4 and sigma 0.9 a few per cent of rows run to the limit; the longest always does, so a
    small set has its tail too)."""
    rng = np.random.default_rng(seed)
    draws = np.exp(np.log(median) + sigma * rng.standard_normal(rows))
    draws[np.argmax(draws)] = max_new_tokens
    return np.clip(np.round(draws), 4, max_new_tokens).astype(int).tolist()


def make_prompts(num_prompts: int, generations: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    """`num_prompts` random prompts of low..high tokens, each repeated `generations` times (a GRPO group's rows)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, vocab, int(rng.integers(low, high + 1))).tolist() for _ in range(num_prompts)]
    return [p for p in prompts for _ in range(generations)]


class Busy:
    """Wall seconds and cores kept busy (CPU seconds of this process and its children / wall) over a block."""

    def __enter__(self):
        self._cpu, self._wall = self._cpu_now(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._wall
        self.cores = (self._cpu_now() - self._cpu) / max(self.seconds, 1e-9)

    @staticmethod
    def _cpu_now() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def time_left_for(seconds: float, deadline: float | None) -> bool:
    """Whether a run as long as the last one (`seconds`) ends before `deadline` (None: no deadline)."""
    return deadline is None or time.perf_counter() + 1.2 * seconds < deadline


def summarize(useful: int | list[int], runs: list[Busy], extra: dict | None = None) -> dict:
    """Median useful tokens/s over the runs (`useful`: the same for every run, or each run's own), with the cores busy
    in the median run."""
    made = useful if isinstance(useful, list) else [useful] * len(runs)
    rates = [n / r.seconds for n, r in zip(made, runs)]
    median = statistics.median(rates)
    middle = runs[min(range(len(runs)), key=lambda i: abs(rates[i] - median))]
    return {"tokens_per_second": round(median, 1), "runs_tokens_per_second": [round(x, 1) for x in rates],
            "cores_busy": round(middle.cores, 2), **(extra or {})}


def time_jax_engine(engine, params, prompts: list[list[int]], budgets: list[int], repeats: int,
                    deadline: float | None = None, stop_tokens: bool = False) -> dict:
    """A JAX engine (continuous or static) on the request set: one untimed run compiles, then `repeats` runs
    (fewer, at least one, where the next would end past `deadline`, a time.perf_counter() value). Every row runs to
    its budget (EOS disabled), or with `stop_tokens` may end early on the engine's own stop tokens, each run then
    rated by the tokens it made (`tokens_made`)."""
    with Busy() as first:
        out = engine.generate(params, prompts, jax.random.key(0), max_new_tokens=budgets)
    if not stop_tokens and list(out.lengths) != list(budgets):
        raise RuntimeError("the engine's completion lengths differ from the budgets; EOS was meant to be disabled")
    runs, made = [], []
    for r in range(repeats):
        if runs and not time_left_for(runs[-1].seconds, deadline):
            break
        with Busy() as run:
            out = engine.generate(params, prompts, jax.random.key(r + 1), max_new_tokens=budgets)
        runs.append(run)
        made.append(int(out.lengths.sum()))
    extra = {"compile_seconds": round(max(0.0, first.seconds - statistics.median(r.seconds for r in runs)), 1)}
    if stop_tokens:
        return summarize(made, runs, {**extra, "tokens_made": made})
    return summarize(sum(budgets), runs, extra)


def time_hf(hf, prompts: list[list[int]], cases: dict[str, list[int]], repeats: int, device: str = "cpu",
            deadline: float | None = None) -> dict:
    """Hugging Face `generate` over the whole request set in one call (static batching: left-padded prompts, the
    batch runs to its longest budget; tokens past a row's budget are not useful), sampling at temperature 1 from
    the full distribution, without per-token logprobs (its faster mode; with 512 rows x 512 steps the scores it
    would keep for them take gigabytes).

    `device`: where `hf` lives ("cpu", "cuda"); `deadline` as in time_jax_engine.
    `cases`: name -> budgets for the same prompts. Static batching makes every case with the same longest budget
    the same work (same prompts, same number of steps), so the set is timed once and each case's rate is its own
    useful tokens over those seconds: name -> result."""
    import torch

    steps = max(max(b) for b in cases.values())
    if any(max(b) != steps for b in cases.values()):
        raise ValueError("time_hf: every case must share the longest budget (the work is then the same)")
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)

    def once(seed: int) -> None:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=steps, min_new_tokens=steps, eos_token_id=None, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        if out.shape != (len(prompts), width + steps):
            raise RuntimeError(f"HF generated {tuple(out.shape)}, not the full length")

    torch.manual_seed(0)  # warm-up on a slice (allocator, kernels): a full untimed run would double the cost
    with torch.no_grad():
        hf.generate(ids[:8], attention_mask=mask[:8], do_sample=True, top_k=0, max_new_tokens=4, min_new_tokens=4,
                    eos_token_id=None, pad_token_id=0)
    runs = []
    for r in range(repeats):
        if runs and not time_left_for(runs[-1].seconds, deadline):
            break
        with Busy() as run:
            once(r + 1)
        runs.append(run)
    extra = {"torch_threads": torch.get_num_threads(), "timed_with": sorted(cases), "device": device}
    return {name: summarize(sum(budgets), runs, extra) for name, budgets in cases.items()}


def time_vllm(model, cases: dict[str, tuple[list[list[int]], list[int]]], repeats: int, max_num_seqs: int) -> dict:
    """vLLM on each case's request set (name -> (prompts, budgets)), one engine for all of them, in the vLLM
    environment: name -> result; each {"missing": why} without that environment."""
    from grpo_stream.common.model.hf_checkpoint import export_hf

    root = pathlib.Path(__file__).resolve().parent.parent
    python = pathlib.Path(os.environ.get("GRPO_STREAM_VLLM_PYTHON", root / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        return {name: {"missing": f"no vLLM environment at {python} (requirements/install-vllm-env.sh)"}
                for name in cases}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        export_hf(tmp, model.arch, model.to_named_numpy())
        workload = pathlib.Path(tmp) / "workload.json"
        workload.write_text(json.dumps({"cases": {name: {"prompts": prompts, "budgets": budgets}
                                                  for name, (prompts, budgets) in cases.items()},
                                        "repeats": repeats, "max_num_seqs": max_num_seqs}))
        proc = subprocess.run([str(python), "-m", "grpo_stream.bench.vllm_decode", tmp, str(workload)], cwd=root,
                              capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"the vLLM measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
