#!/usr/bin/env bash
# vLLM on TPU, the check for a single-host Cloud TPU VM (v5e-8, v6e-8, v5p-8, ...; 4 or 8 chips): 2 RL steps of
# GSM8K on Qwen2.5 0.5B Instruct, the JAX trainer on the first half of the chips and a vllm-tpu sampler
# (sampler.engine=vllm, tpu-inference) on the other half; once with weights installed after a drain (no request
# live) and once in flight (the scheduler paused with its requests kept). Writes OUT/drain.json and OUT/in_flight.json in the
# smoke format (grpo_stream/reports/smoke.py; docs/tpu.md, "The check to run on a TPU VM"). Please send both files
# back (an issue on the project): nothing of the TPU path has run on a TPU before.
#
#   bash scripts/tpu-vllm-smoke.sh [OUT] [MODEL_DIR]
#
# OUT defaults to runs/tpu-vllm-smoke; MODEL_DIR to OUT/model, downloaded from the Hugging Face Hub when missing.
# Needs the TPU VM's network (PyPI, the Hub, GSM8K from the Hub) and about 15 minutes, most of it installs.
# Chips are split with libtpu's per-process variables (TPU_VISIBLE_CHIPS, TPU_CHIPS_PER_PROCESS_BOUNDS,
# TPU_PROCESS_BOUNDS, TPU_PROCESS_PORT); set TRAINER_CHIPS / SAMPLER_CHIPS / CHIP_BOUNDS to override the guess below.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out=$(realpath -m "${1:-runs/tpu-vllm-smoke}")
model=$(realpath -m "${2:-$out/model}")
mkdir -p "$out"

[ -x .venv/bin/python ] || { python3 -m venv .venv && .venv/bin/pip install -q -e ".[tpu]"; }
[ -x .venv-vllm-tpu/bin/python ] || bash requirements/install-vllm-env.sh .venv-vllm-tpu tpu
if [ ! -f "$model/config.json" ]; then
  .venv/bin/python -c "import sys; from huggingface_hub import snapshot_download
snapshot_download('Qwen/Qwen2.5-0.5B-Instruct', local_dir=sys.argv[1])" "$model"
fi

chips=$(.venv/bin/python -c "import jax; assert jax.devices()[0].platform == 'tpu', jax.devices(); print(jax.device_count())")
half=$((chips / 2))
if [ "$half" -ge 4 ]; then bounds_default=2,2,1; elif [ "$half" -eq 2 ]; then bounds_default=1,2,1; else bounds_default=1,1,1; fi
trainer_chips=${TRAINER_CHIPS:-$(seq -s, 0 $((half - 1)))}
sampler_chips=${SAMPLER_CHIPS:-$(seq -s, "$half" $((chips - 1)))}
bounds=${CHIP_BOUNDS:-$bounds_default}
echo "[smoke] $chips chips: trainer $trainer_chips, sampler $sampler_chips (bounds $bounds each)"

for mode in drain in_flight; do
  run="$out/run-$mode"
  rm -rf "$run"
  .venv/bin/grpo-stream up --config configs/qwen2.5_0.5b_tpu_vllm_smoke.yaml --run-dir "$run" \
    "model.path=$model" "sampler.weight_updates=$mode" "sampler.python=$root/.venv-vllm-tpu/bin/python" \
    "trainer.mesh.fsdp=$half" "sampler.vllm.tensor_parallel_size=$half" \
    "hardware.trainer_env={TPU_VISIBLE_CHIPS: '$trainer_chips', TPU_CHIPS_PER_PROCESS_BOUNDS: '$bounds', TPU_PROCESS_BOUNDS: '1,1,1', TPU_PROCESS_PORT: '8476'}" \
    "hardware.sampler_env={TPU_VISIBLE_CHIPS: '$sampler_chips', TPU_CHIPS_PER_PROCESS_BOUNDS: '$bounds', TPU_PROCESS_BOUNDS: '1,1,1', TPU_PROCESS_PORT: '8477'}" \
    || echo "[smoke] $mode: up exited with $? (the report says what ran)"
  # an `up` that stopped before saving its config leaves nothing to report: say so and go on to the other mode
  if ! .venv/bin/python -m grpo_stream.reports.smoke "$run" --python .venv/bin/python \
      --python .venv-vllm-tpu/bin/python --out "$out/$mode.json"; then
    echo "[smoke] $mode: no result written; please send $run/logs and the output above instead"
    continue
  fi
  .venv/bin/python -c "import json, sys; r = json.load(open(sys.argv[1])); print('[smoke]', sys.argv[2], 'passed' if r['passed'] else 'FAILED', {k: c['value'] for k, c in r['checks'].items()})" "$out/$mode.json" "$mode"
done
echo "[smoke] results: $out/drain.json $out/in_flight.json (logs under $out/run-*/logs)"
