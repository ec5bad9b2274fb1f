"""The whole loop proved on one GPU, phase by phase: `scripts/gpu-check.sh [--dry-run] [--out DIR] [--deadline-s S]`.

The script's header says how to run it and what each phase proves. This module runs the phases as processes
(`grpo-stream up` for the runs; the environment probe, the checkpoint and `grpo-stream plan` each in a process of
its own, so this one never takes the GPU) and writes OUT/gpu-check.json after every phase: a phase that ends writes
its result at once, and one that would start past the deadline is recorded as skipped. A run still going at its
phase's end (its share of the time, or the deadline less the time a stopped run needs to end) is stopped as Ctrl-C
stops `up`, and reports what it did. Each run's output is in OUT/<phase>.log, its files in the work directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from grpo_stream.bench.async_vs_sync import mode_overrides
from grpo_stream.gpu_check.engine import engine_command
from grpo_stream.gpu_check.env import environment
from grpo_stream.gpu_check.figures import comparison, missing_figures, run_figures
from grpo_stream.gpu_check.model import SHAPE, gsm8k_source
from grpo_stream.gpu_check.modes import CHIPS, DRY, GPU, Mode, memory_dir, setup_seconds
from grpo_stream.gpu_check.processes import LOG_TAIL, kill_all, run_process
from grpo_stream.gpu_check.realmodel import run_realmodel

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIG_CONFIG = "configs/qwen2.5_1.5b_gsm8k_gpu.yaml"  # the GPU preset: its trainer settings, GSM8K's prompt shape


def log(message: str) -> None:
    print(f"gpu-check {time.strftime('%H:%M:%S')}: {message}", file=sys.stderr, flush=True)


class Runner:
    """Runs the phases against one deadline and keeps the JSON document up to date."""

    def __init__(self, mode: Mode, out: pathlib.Path, work: pathlib.Path, deadline_s: float, dry_run: bool,
                 setup_s: float = 0.0):
        self.mode, self.out, self.work, self.dry_run = mode, out, work, dry_run
        self.started = time.monotonic()
        self.end = self.started + deadline_s - setup_s  # the deadline counts from the script's start (setup_seconds)
        self.stopping = threading.Event()  # SIGINT/SIGTERM: stop the run in progress, skip the rest
        # on a GPU the engine and the one-process run come if time remains (Mode.min_run_s); the dry run needs all
        self.optional = () if dry_run else ("engine", "colocated")
        self.doc: dict = {"dry_run": dry_run, "deadline_s": deadline_s, "setup_s": round(setup_s, 1),
                          "work_dir": str(work), "phases": {},
                          "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
        self.cache = work / "jax-cache"  # one compilation cache: a later run loads what an earlier one compiled
        self.fast_dir = None if dry_run else memory_dir(work.name)
        self.live: set[subprocess.Popen] = set()  # processes running now (the phase's, and the plan beside it)

    # -- the document ------------------------------------------------------------------------------------------
    def record(self, phase: str, result: dict) -> None:
        self.doc["phases"][phase] = result
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 1)
        tmp = self.out / "gpu-check.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=2) + "\n")
        tmp.replace(self.out / "gpu-check.json")

    def left(self) -> float:
        return self.end - time.monotonic()

    def stop_time(self, phase: str) -> tuple[float, str]:
        """When a run of `phase` starting now is stopped, and what sets it: its cap, or the deadline less the time a
        stopped run needs to end."""
        cap, deadline = time.monotonic() + self.mode.caps[phase], self.end - self.mode.stop_grace_s
        return (cap, "cap") if cap <= deadline else (deadline, "deadline")

    # -- processes ---------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], log_path: pathlib.Path, stop_at: float, env: dict | None = None) -> dict:
        """Run `cmd` until it ends or `stop_at`, then stop it (processes.run_process)."""
        return run_process(cmd, log_path, stop_at, self.stopping, self.live, self.mode.stop_grace_s, env)

    def up(self, phase: str, args: list[str], steps: int, plan: dict | None = None, colocated: bool = False) -> dict:
        """One `grpo-stream up` run as phase `phase`; its figures whether it ended or was stopped."""
        run_dir = self.work / phase
        if self.fast_dir is not None:  # the last step's checkpoint (17 GB at the ~1B shape) goes to memory
            args = [*args, f"checkpoint.dir={self.fast_dir / phase}"]
        stop_at, bound = self.stop_time(phase)
        log(f"{phase}: grpo-stream up {' '.join(args)} (at most {stop_at - time.monotonic():.0f}s)")
        cmd = [sys.executable, "-m", "grpo_stream", "up", "--run-dir", str(run_dir), *args,
               "trainer.metrics_port=null", "sampler.metrics_port=null", f"runtime.compilation_cache_dir={self.cache}"]
        result = {"command": cmd[2:], "time_bound": bound, **self.run(cmd, self.out / f"{phase}.log", stop_at)}
        result["status"] = "stopped" if result["stopped"] else ("ok" if result["exit_code"] == 0 else "failed")
        result["figures"] = run_figures(run_dir, steps, plan, colocated)
        for bulky in ("checkpoints", "model", "weights"):  # GBs at full size; the figures are read
            shutil.rmtree(run_dir / bulky, ignore_errors=True)
        if self.fast_dir is not None:
            shutil.rmtree(self.fast_dir / phase, ignore_errors=True)
        log(f"{phase}: {result['status']} in {result['seconds']}s, {result['figures']['steps']} steps")
        return result

    def engine_alone(self, args: list[str], sync: list[str]) -> dict:
        """The ~1B runs' sampler engine alone on the device (`bench gpu engine`, engine.py): what their samplers'
        tokens/s are set against (issue 55). It stops starting loads 10 s before its cap and writes each as it ends,
        so a stopped run keeps the loads it measured."""
        out_json = self.work / "engine.json"
        out_json.unlink(missing_ok=True)  # a run on a reused --work must not read an earlier run's figures
        stop_at, bound = self.stop_time("engine")
        cmd, held = engine_command(args, sync, self.cache, out_json, max(stop_at - time.monotonic() - 10, 1))
        log(f"engine: bench gpu engine (at most {stop_at - time.monotonic():.0f}s)")
        result = {"command": cmd[2:], "time_bound": bound, **self.run(cmd, self.out / "engine.log", stop_at)}
        try:
            doc = json.loads(out_json.read_text())
        except (OSError, ValueError):
            doc = None
        result["status"] = ("ok" if doc and doc.get("tokens_per_second") else "stopped" if result["stopped"] else
                            "failed")
        result["figures"] = doc and {**doc, "sync_admitted_rows": held}
        # the loads asked for that it did not time (skipped past its deadline, or not reached before its stop)
        asked = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--rows"]
        timed = ((doc or {}).get("loads") or {})
        result["loads_untimed"] = [n for n in asked if "tokens_per_second" not in timed.get(n, {})]
        log(f"engine: {result['status']} in {result['seconds']}s")
        return result

    def background(self, name: str, cmd: list[str], env: dict | None = None) -> dict:
        out = self.run(cmd, self.work / f"{name}.log", self.end, env)
        out["status"] = "stopped" if out["stopped"] else ("ok" if out["exit_code"] in (0, 1) else "failed")
        return out

    # -- phases ------------------------------------------------------------------------------------------------
    def environment(self) -> dict:
        return environment(ROOT, LOG_TAIL)

    def big_args(self, ckpt: pathlib.Path, gsm8k: pathlib.Path) -> list[str]:
        """Overrides of the ~1B phases: the preset with the random checkpoint, GSM8K prompts in plain form, one
        sampler, no evaluation, one checkpoint (the last step's) without its hash."""
        m, g = self.mode, self.mode.groups_per_step
        return ["--config", BIG_CONFIG, f"model.path={ckpt}", "model.pad_token=<pad>",
                f"task.dataset.source={gsm8k}", "task.prompt_template=plain", f"trainer.steps={m.steps}",
                f"trainer.optimizer.warmup_steps={max(1, m.steps // 10)}", "trainer.eval_before=false",
                "trainer.eval_after=false", "sampler.replicas=1", f"trainer.groups_per_step={g}",
                f"buffer.max_groups={2 * g}", "sampler.weight_poll_s=0.02",
                "checkpoint.every=1000000", "checkpoint.verify=false", "trainer.final_wait_s=30", *m.big]

    def main(self, realmodel: bool = False) -> int:
        try:
            return run_realmodel(self) if realmodel else self._main()
        finally:  # nothing of the check outlives it (its processes run in sessions of their own)
            self.stopping.set()
            self.kill_live()

    def kill_live(self) -> None:
        kill_all(self.live)

    def _main(self) -> int:
        m = self.mode
        self.record("environment", self.environment())
        env = self.doc["phases"]["environment"]
        if reason := self.no_gpu():
            for phase in ("demo", "async", "sync", "engine", "colocated"):
                self.record(phase, {"status": "skipped", "reason": reason})
            log(reason)
            self.finish({})
            return self.verdict()
        gsm8k, where = gsm8k_source(None, self.work)
        self.doc["gsm8k"] = {"path": str(gsm8k), "from": where}
        ckpt = self.work / (SHAPE if m.shape == SHAPE else f"{SHAPE}-tiny")
        kind = next((d["kind"] for d in env.get("devices", [])), "")
        chip = next((v for k, v in CHIPS.items() if k in kind.upper()), None)
        jobs: dict = {}
        made = threading.Event()

        def checkpoint_then_plan() -> None:  # beside the demo: the checkpoint, then the plan of the ~1B runs
            cpu = {**os.environ, "JAX_PLATFORMS": "cpu"}
            try:
                jobs["model"] = self.background("checkpoint", [
                    sys.executable, "-m", "grpo_stream.gpu_check.model", str(ckpt), "--shape", m.shape, "--gsm8k",
                    str(gsm8k)], cpu)
            finally:
                made.set()
            if jobs["model"]["exit_code"] == 0:
                plan_json = self.work / "plan.json"
                jobs["plan"] = self.background("plan", [
                    sys.executable, "-m", "grpo_stream", "plan", "--json", str(plan_json),
                    *self.big_args(ckpt, gsm8k), *([f"hardware.trainer_chip={chip}"] if chip else [])], cpu)
                doc = json.loads(plan_json.read_text()) if plan_json.exists() else None
                jobs["plan_doc"] = doc
                if doc:
                    jobs["plan"].update(fits=doc.get("fits"), trainer_bytes=doc["trainer"]["per_device_bytes"]["total"],
                                        sampler_bytes=doc["sampler"]["per_device_bytes"]["total"])

        side = threading.Thread(target=checkpoint_then_plan, daemon=True)
        if self.left() > m.stop_grace_s:
            side.start()
        else:
            made.set()
        self.phase("demo", lambda: self.demo())
        made.wait(timeout=max(self.left() - m.stop_grace_s, 0))
        if "model" not in jobs or jobs["model"]["exit_code"] != 0:
            self.doc["checkpoint"] = jobs.get("model", {"status": "not made before the deadline"})
            for phase in ("async", "sync", "engine", "colocated"):
                self.record(phase, {"status": "skipped", "reason": "deadline" if "model" not in jobs
                                    else "no checkpoint"})
        else:
            printed = [line for line in (self.work / "checkpoint.log").read_text().splitlines() if line.startswith("{")]
            self.doc["checkpoint"] = {**jobs["model"], **(json.loads(printed[-1]) if printed else {})}
            base = self.big_args(ckpt, gsm8k)
            # the plan's figures, when it ended in time, size the shares of the GPU (hardware.plan_json); else `up`
            # splits it by its default rule (the trainer twice the sampler)
            plan_json = self.work / "plan.json"
            if jobs.get("plan_doc"):
                base.append(f"hardware.plan_json={plan_json}")
            self.doc["memory_shares_from"] = "plan" if f"hardware.plan_json={plan_json}" in base else "default split"
            g = m.groups_per_step
            runs = {"async": mode_overrides("async", g, 1), "sync": mode_overrides("sync", g, 1)}
            for phase, extra in runs.items():
                self.phase(phase, lambda p=phase, e=extra: self.up(p, [*base, *e], m.steps, jobs.get("plan_doc")))
            self.phase("engine", lambda: self.engine_alone(base, runs["sync"]))  # before the optional one
            self.phase("colocated", lambda: self.up("colocated", [*base, *runs["async"], "weights.transport=local"],
                                                    m.steps, jobs.get("plan_doc"), colocated=True))
        if side.is_alive():
            side.join(timeout=max(self.left(), 0))
        self.finish(jobs)
        return self.verdict()

    def no_gpu(self) -> str | None:
        """Why a GPU run must end after its environment phase, or None. JAX without its GPU (a CUDA plugin that failed
        to load falls back to the CPU) would spend every phase's cap on the CPU and measure nothing: ending at once
        leaves the device time for a run after a fix."""
        env = self.doc["phases"]["environment"]
        if self.dry_run or env.get("backend") == "gpu":
            return None
        why = "; its probe_stderr says why" if env.get("probe_stderr") else ""
        return f"no GPU: the environment phase found JAX's backend {env.get('backend')!r} ({env.get('status')}{why})"

    def phase(self, name: str, body) -> None:
        """Run phase `name` (`body` returns its result) if there is time for it: an optional one needs the least
        time in which it can give its figures (Mode.min_run_s; less would spend the device's time on nothing), then
        one that falls short of its figures when the deadline stops it is excused as one skipped for it."""
        if self.stopping.is_set() or self.left() < self.mode.stop_grace_s + self.mode.min_run_s.get(name, 10.0):
            self.record(name, {"status": "skipped", "reason": "interrupted" if self.stopping.is_set() else
                               "deadline"})
            log(f"{name}: skipped")
            return
        # in the JSON while it runs: a call killed at the device tool's limit says which phase it was in
        self.record(name, {"status": "running", "started_at_s": round(time.monotonic() - self.started, 1)})
        try:
            result = body()
            short = result.get("status") == "stopped" or (result.get("status") == "ok" and result.get("loads_untimed"))
            if name in self.optional and short and result.get("time_bound") == "deadline":
                result["reason"] = "deadline"
        except Exception as error:  # noqa: BLE001 - one phase's fault must not lose the phases after it
            result = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                      "log_tail": traceback.format_exc()[-LOG_TAIL:]}
            log(f"{name}: failed: {result['error']}")
        self.record(name, result)

    def demo(self) -> dict:
        """The shipped demo (or the dry run's few steps): its figures and the held-out greedy accuracy's change."""
        args = list(self.mode.demo)
        result = self.up("demo", args, self._steps(args))
        evals = [self._summary("demo").get(k) or {} for k in ("eval_before", "eval_after")]
        before, after = (e.get("accuracy") for e in evals)
        sampled = [(e.get("pass_at_k") or {}).get("1") for e in evals]  # with eval.samples
        gain = round(100 * (after - before), 2) if before is not None and after is not None else None
        bar = self.mode.learning_bar
        result["learning"] = {"greedy_before": before, "greedy_after": after, "gain_points": gain,
                              "sampled_pass1_before": sampled[0], "sampled_pass1_after": sampled[1],
                              "bar_points": None if bar is None else 100 * bar,
                              "passed": None if bar is None or gain is None else gain >= 100 * bar}
        return result

    def _summary(self, phase: str) -> dict:
        try:
            return json.loads((self.work / phase / "summary.json").read_text())
        except (OSError, ValueError):
            return {}

    def _steps(self, args: list[str]) -> int:
        """trainer.steps of a run given these arguments (the config's, unless overridden)."""
        from grpo_stream.common.config.loading import load_config  # noqa: PLC0415

        config = args[args.index("--config") + 1]
        return load_config(ROOT / config, [a for a in args if "=" in a]).trainer.steps

    def finish(self, jobs: dict) -> None:
        phases = self.doc["phases"]
        plan = jobs.get("plan") or {"status": "skipped", "reason": "no checkpoint" if "model" not in jobs
                                    or jobs["model"]["exit_code"] != 0 else "deadline"}
        phases["plan"] = plan
        if self.fast_dir is not None:
            shutil.rmtree(self.fast_dir, ignore_errors=True)
        for p in ("async", "sync", "colocated"):  # again, with the plan's figures if it ended after the run
            if "figures" in (phases.get(p) or {}):
                phases[p]["figures"] = run_figures(self.work / p, self.mode.steps, jobs.get("plan_doc"),
                                                   colocated=p == "colocated")
        figures = {p: (phases.get(p) or {}).get("figures") or {} for p in ("async", "sync", "colocated", "engine")}
        phases["comparison"] = comparison(figures["async"], figures["sync"], figures["colocated"], figures["engine"])
        # on a GPU the engine, the one-process run and the plan come if time remains; the dry run must have everything
        optional = () if self.dry_run else (*self.optional, "plan")
        self.doc["missing_figures"] = missing_figures(phases, device_memory=not self.dry_run, optional=optional)
        self.record("plan", plan)

    def verdict(self) -> int:
        phases, failed = self.doc["phases"], [reason] if (reason := self.no_gpu()) else []
        failed += [f"{p}: {(phases.get(p) or {}).get('status')}" for p in ("environment", "demo", "async", "sync",
                                                                            "engine", "colocated")
                   if (phases.get(p) or {}).get("status") != "ok"
                   and not (p in self.optional and phases[p].get("reason") == "deadline")]
        learning = (phases.get("demo") or {}).get("learning") or {}
        if learning.get("passed") is False:
            failed.append(f"demo learning: +{learning['gain_points']} points < {learning['bar_points']}")
        if self.doc["missing_figures"]:
            failed.append(f"missing figures: {', '.join(self.doc['missing_figures'])}")
        self.doc["passed"], self.doc["problems"] = not failed, failed
        self.record("plan", phases["plan"])
        log(f"{'passed' if not failed else 'NOT passed: ' + '; '.join(failed)} in {self.doc['elapsed_s']}s; "
            f"wrote {self.out / 'gpu-check.json'}")
        return 0 if not failed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same phases on the CPU at tiny shapes")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/gpu-check"),
                        help="where gpu-check.json and each run's log go (a few small files)")
    parser.add_argument("--work", type=pathlib.Path, help="where the runs, the checkpoint and the plan go (GBs at "
                        "full size; kept; default: a new temporary directory, removed at the end)")
    parser.add_argument("--deadline-s", type=float, help="the whole check's time from the script's start, the "
                        "wheels' install included (default: 570 on a GPU, 330 dry)")
    parser.add_argument("--steps", type=int, help="RL steps of each ~1B run (default 16; 6 dry)")
    parser.add_argument("--demo-steps", type=int, help="RL steps of the demo (default: its config's, 400)")
    parser.add_argument("--cap", action="append", default=[], metavar="PHASE=S", help="the most seconds a phase "
                        "may take (demo, async, sync, engine, colocated, realmodel; on a GPU by default 150, 180, "
                        "150, 90, 120, 420); repeatable")
    parser.add_argument("--realmodel", action="store_true", help="only the real-model phase: SmolLM2 from the carried "
                        "GGUF parts on GSM8K (grpo_stream/gpu_check/realmodel.py)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of the "
                        "~1B runs (e.g. generation.max_new_tokens=128); repeatable")
    args = parser.parse_args(argv)
    mode = DRY if args.dry_run else GPU
    caps = {phase: float(seconds) for phase, seconds in (c.split("=", 1) for c in args.cap)}
    if set(caps) - set(mode.caps):
        parser.error(f"--cap: phases are {', '.join(mode.caps)}")
    mode = dataclasses.replace(mode, steps=args.steps or mode.steps, caps={**mode.caps, **caps},
                               big=(*mode.big, *args.set),
                               demo=(*mode.demo, *([f"trainer.steps={args.demo_steps}"] if args.demo_steps else [])))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="grpo-stream-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    runner = Runner(mode, args.out.resolve(), work.resolve(),
                    mode.deadline_s if args.deadline_s is None else args.deadline_s, args.dry_run,
                    setup_seconds(os.environ.pop("GPU_CHECK_STARTED", None)))

    def stop(signum, _frame):
        log(f"signal {signum}: stopping the run in progress; the rest is skipped")
        runner.stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        return runner.main(args.realmodel)
    finally:
        if args.work is None:  # the JSON and the logs are in --out; the runs and the checkpoint (GBs) go
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
