#!/usr/bin/env bash
# The whole loop proved on one GPU in about 9 minutes (issue 40): one command, one JSON file of figures.
#
#   bash scripts/gpu-check.sh [--dry-run] [--out DIR] [--work DIR] [--deadline-s S]
#
# Phases, each written to DIR/gpu-check.json (default runs/gpu-check) as soon as it ends (and as "running" while it
# runs); a phase that would start past the deadline (default 570 s in all, counted from this script's start, the
# wheels' install included, inside the device tool's 600 s a call) is recorded as skipped, and a run still going at
# its phase's end is stopped as Ctrl-C stops `up` and reports what it did; the processes die with the check:
#   1. environment: the driver (nvidia-smi), the versions of python, jax, jaxlib, flax, optax, orbax, transformers,
#      grpcio, protobuf (torch if present), the devices and their memory. Proves the stack imports and sees the GPU;
#      where JAX sees none (a CUDA plugin that failed to load falls back to the CPU) the check ends there.
#   2. demo: the shipped CPU demo (configs/tiny_arith.yaml: warm start, 400 RL steps, held-out evaluation) under
#      `grpo-stream up`, trainer and two samplers sharing the GPU. Proves the loop learns there: held-out greedy
#      accuracy must rise by at least 10 points (the demo's mean on CPU is 17).
#   3. async: a Llama-3.2-1B-shaped model (1.24B parameters, random init, bfloat16; the shape bench/gpu.py
#      measures) on GSM8K prompts (GSM8K-shaped ones when no GSM8K files are at hand), the GPU preset's trainer
#      settings (configs/qwen2.5_1.5b_gsm8k_gpu.yaml: full remat, micro-batches of 2, a KL reference, 8 groups of 4,
#      256 new tokens), 16 asynchronous steps under `up`, one trainer and one JAX sampler sharing the GPU (their
#      shares from the plan's figures, hardware.plan_json, when the plan below ended in time; else up's default).
#   4. sync: the same, synchronous (trainer.max_staleness=0; the sampler makes one step's groups per version).
#   5. engine, if time remains: the sampler's engine of 3-4 alone on the GPU (`python -m grpo_stream.bench.gpu
#      engine`, the same config), kept full and at the rows 4's admission allows; the samplers' tokens/s while
#      generating are set against both (issue 55: `comparison.sampler_over_engine_*`, its goal >= 0.8 read at the
#      same rows; grpo_stream/gpu_check/engine.py).
#   6. colocated, if time remains: the same as 3 in one process (weights.transport=local).
#   Beside 2, on the CPU: the checkpoint of 3-6, then `grpo-stream plan` of the same config (deadline permitting).
# --realmodel instead runs the environment and one phase: SmolLM2-135M-Instruct (a real pretrained model) converted
#   there from GGUF parts carried over earlier calls, on GSM8K under `up` (configs/smollm2_gsm8k.yaml, --steps steps),
#   held-out accuracy before and after, tokens/s per process; how to carry the parts: grpo_stream/gpu_check/realmodel.py.
# Per run the JSON has steps and steps/s, the trainer's compute against its wait for data, the sampler's tokens/s,
# publish->installed seconds and GB/s per weight version, each process's peak device memory against plan's figure,
# and the lag-0 logprob agreement; then async/sync beside its overlap bound (bench/async_vs_sync.py's). Exit 0 when
# every phase ended and every figure is there (and the demo learned), else 1; `passed` and `problems` say why.
# DIR also gets each run's output (demo.log, async.log, ...); the runs themselves go to --work (kept; default a new
# temporary directory, removed at the end; GBs at full size, the bulky parts deleted after each run).
#
# --dry-run: the same phases on the CPU at tiny shapes (the smoke demo, a 2-layer model of the same family, 6 steps),
# checking that the JSON has every figure; the bench test lane runs it (tests/bench/test_gpu_check_dry_run.py):
# 190-270 s on 2 cores beside other work (2026-11-30, with the engine phase). --steps, --demo-steps, --cap PHASE=S
# and --set KEY=VALUE (the ~1B runs' config) adjust a GPU run that does not fit its deadline.
#
# With the device tool (one call; the wheels and the GSM8K sample travel in .whl, which git ignores):
#   run(command="bash scripts/gpu-check.sh --out $OUT 2>&1 | tee $OUT/gpu-check.log", carry=[".whl"], timeout_s=600)
#
# On a machine where the project is not installed (the GPU machine: Python 3.12 with jax, flax, transformers and
# grpcio preinstalled, no network), it runs from this checkout: the packages the image lacks come as wheels in .whl
# (`bash scripts/gpu-wheels.sh` here, once; the folder travels with the tree), installed into a private directory
# ($GPU_CHECK_SITE, default /tmp/grpo-stream-gpu-check-site), and the checkout's root goes on PYTHONPATH (its
# grpo_stream/ links every package folder). Python: $GPU_CHECK_PYTHON, else .venv/bin/python when
# it has the project, else python3. The GPU layout and memory settings of each process are `up`'s (its device
# planner), not this script's.
set -euo pipefail
# the deadline counts from here: the install below is inside the device tool's call too (modes.setup_seconds)
export GPU_CHECK_STARTED="$(date +%s)"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
site=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/grpo-stream-gpu-check-site}
wheels=${GPU_CHECK_WHEELS_DIR:-$root/.whl}
# the checkout's grpo_stream, never the folder of the same name in the working directory
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1

if [ -n "${GPU_CHECK_PYTHON:-}" ]; then py=$GPU_CHECK_PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import grpo_stream.gpu_check.run" 2>/dev/null; then py=.venv/bin/python
else py=python3; fi

ready() {  # the project and what it imports at run time, at versions its generated gRPC code accepts
  "$py" - "$root" <<'EOF' 2>/dev/null
import pathlib, sys
import grpo_stream
assert pathlib.Path(grpo_stream.__file__).resolve().parent.parent == pathlib.Path(sys.argv[1]), grpo_stream.__file__
import grpc_health.v1.health, grpc_reflection.v1alpha.reflection, pydantic, redis, tensorboardX, tunix.models.llama3.model
import grpo_stream.protos.rollout_pb2_grpc, grpo_stream.protos.weights_pb2_grpc, grpo_stream.trainer_service.loop
EOF
}

if ! ready; then
  shopt -s nullglob
  found=("$wheels"/*.whl)
  if [ ${#found[@]} -gt 0 ]; then
    echo "gpu-check: installing ${#found[@]} carried wheels from $wheels into $site/wheels" >&2
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site/wheels" \
      "${found[@]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    export PYTHONPATH="$site/wheels${PYTHONPATH:+:$PYTHONPATH}"
    export GPU_CHECK_WHEELS="$(cd "$wheels" && ls ./*.whl | sed 's|^\./||' | tr '\n' ' ')"
  fi
  # the checkout's root: grpo_stream/ there links every package folder (pyproject.toml says why)
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
  if ! ready; then
    echo "gpu-check: $py cannot import the project and what it needs at run time; here is why:" >&2
    ready_err=$("$py" -c "import grpc_health, grpc_reflection, pydantic, redis, tensorboardX, tunix.models.llama3.model
import grpo_stream.protos.rollout_pb2_grpc, grpo_stream.trainer_service.loop" 2>&1 | tail -3) || true
    echo "$ready_err" >&2
    echo "gpu-check: run 'bash scripts/gpu-wheels.sh' where PyPI is reachable and bring .whl along" >&2
    exit 2
  fi
fi
exec "$py" -m grpo_stream.gpu_check "$@"
