#!/usr/bin/env bash
# Make the GPU stack's JAX environment: bash requirements/install-env.sh DIR cuda|gpu-stack-cpu [EXTRA ...]
#   cuda           requirements/cuda.txt: JAX 0.11.2 with its CUDA 13 plugin (NVIDIA driver >= 580)
#   gpu-stack-cpu  requirements/gpu-stack-cpu.txt: the same pins without the plugin, to test the set on a CPU host
#   EXTRA          optional-dependency groups of pyproject.toml whose pins are added too (test, bench, tensorboard)
# DIR: a new or existing virtualenv (created when missing) on Python >= 3.12 (jax 0.11.2); PYTHON picks the
# interpreter for a new DIR (default python3.12). Run from anywhere; installs this checkout.
# Why a script and not `pip install ".[cuda]"`: requirements/gpu-stack-cpu.txt, first lines (pyproject pins jax
# 0.10.2; Tunix's safetensors cap). The vLLM engine's environments: requirements/install-vllm-env.sh.
set -euo pipefail
usage="usage: install-env.sh DIR cuda|gpu-stack-cpu [EXTRA ...]"
dir=${1:?$usage}
flavor=${2:?$usage}
shift 2
root="$(cd "$(dirname "$0")/.." && pwd)"
case "$flavor" in
  cuda|gpu-stack-cpu) ;;
  *) echo "flavor must be cuda or gpu-stack-cpu, not '$flavor'" >&2; exit 2;;
esac
[ -x "$dir/bin/python" ] || "${PYTHON:-python3.12}" -m venv "$dir"
if ! "$dir/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "$dir: this environment needs Python >= 3.12 (jax 0.11.2); make DIR with python3.12 or set PYTHON" >&2
  exit 2
fi
pip=("$dir/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install -r "$root/requirements/$flavor.txt"
"${pip[@]}" install --no-deps google-tunix==0.1.7
"${pip[@]}" install --no-deps -e "$root"
if [ $# -gt 0 ]; then
  # the extras' pins as pyproject.toml lists them (a `.[test]` install would pull the base dependencies' jax 0.10.2)
  mapfile -t pins < <("$dir/bin/python" - "$root/pyproject.toml" "$@" <<'EOF'
import sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
for name in sys.argv[2:]:
    if name not in extras:
        sys.exit(f"no extra {name!r} in pyproject.toml (there are: {', '.join(sorted(extras))})")
    print("\n".join(extras[name]))
EOF
  )
  "${pip[@]}" install "${pins[@]}"
fi
# Tunix's model families as the project imports them: a module missing from Tunix's unlisted dependencies shows here
"$dir/bin/python" -c "import jax, flax, grpo_stream.trainer_service.learning.train_step, tunix.models.llama3.model, \
tunix.models.qwen2.model, tunix.models.qwen3.model, tunix.models.gemma.model, tunix.models.gemma3.model, \
tunix.rl.algo_core; print('jax', jax.__version__, 'flax', flax.__version__, 'environment ready')"
