#!/usr/bin/env bash
# One-shot GPU check on a machine with an NVIDIA GPU, no network, Python 3.12 with numpy, tokenizers,
# jinja2, typer, rich, psutil, httpx, pytest (what .gpu/wheels lacks):
#   bash bench/gpu/run.sh            (from the repository root; writes its logs and results to $OUT)
# 1. the Python packages of .gpu/wheels into /tmp/site; Potluck from src/ (not installed)
# 2. llama.cpp's llama-bench with ggml's CUDA backend from .gpu/llama.cpp (bench/gpu/prepare.sh), into
#    /tmp/lcpp; the full-size synthetic 7B (bench/make_model.py, header from .gpu/qwen7b-header)
#    built meanwhile
# 3. Potluck on that build of ggml (POTLUCK_GGML=/tmp/lcpp/bin): doctor, tests/test_gpu.py,
#    drop_repro.py, then on the 7B: llama-bench -ngl 99, bench_single.py --ngl 99 (both engines),
#    potluck run -ngl 99, and with time left bench_single.py --ngl 14
# Every step has a timeout, capped so that the whole run ends before DEADLINE_S (default 530 s).
# Dry runs on a machine without a GPU: ONLY_CONFIGURE=1 stops after CMake's configure step;
# CUDA=OFF builds llama.cpp for the CPU only (every later step then runs, without a GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
exec 3>&1  # the log, for step's own lines when its command's output goes to a file
trap 'exec >&- 2>&- 3>&-; sleep 1' EXIT  # let tee write the last lines before the run ends
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-530}
BUILD=${BUILD:-/tmp/lcpp}
CUDA=${CUDA:-ON}
export PYTHONUNBUFFERED=1 POTLUCK_MDNS=0 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export POTLUCK_CACHE=/tmp/potluck-cache  # make_model's 7B goes to $POTLUCK_CACHE/bench
export PYTHONPATH=/tmp/site:$ROOT/src:$ROOT/.gpu/qwen7b-header
export GIT_CEILING_DIRECTORIES=$ROOT  # llama.cpp's CMake asks git for its commit: not Potluck's

elapsed() { echo $(($(date +%s) - T0)); }
# step NAME SECONDS CMD...: run CMD with a timeout of SECONDS, at most what is left before the
# deadline; logs start, end, exit code and duration. Returns CMD's exit code.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE_S - $(elapsed) - 5))
  if ((left < 10)); then
    echo "=== [$(elapsed) s] SKIP $name: ${left} s left before the deadline" >&3
    return 124
  fi
  ((limit > left)) && limit=$left
  echo "=== [$(elapsed) s] $name (timeout ${limit} s): $*" >&3
  local t=$(date +%s)
  timeout -k 10 "$limit" "$@"
  local rc=$?
  echo "=== [$(elapsed) s] $name: exit $rc in $(($(date +%s) - t)) s" >&3
  return $rc
}

echo "=== potluck GPU check $(date -u +%FT%TZ) in $ROOT"
nvidia-smi -L
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
echo "nproc $(nproc)"
free -g | head -2
df -h /tmp | tail -1
python3 --version
uname -m
ldd --version | head -1

# -- 1. Python packages -----------------------------------------------------------------------------
step wheels 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .gpu/wheels/*.whl
step imports 60 python3 -c "
import importlib.metadata as md, sys
for p in ('grpcio', 'protobuf', 'gguf', 'numpy', 'tokenizers', 'typer', 'rich', 'psutil', 'httpx',
          'pydantic', 'fastapi', 'anyio', 'typing_extensions', 'pyyaml', 'pytest'):
    try:
        print(f'  {p} {md.version(p)}')
    except md.PackageNotFoundError:
        print(f'  {p} MISSING')
import gguf, grpc, google.protobuf, fastapi, pydantic, uvicorn, zeroconf, cryptography, numpy
import potluck, potluck.cli, potluck.api.app, potluck.transport.potluck_pb2_grpc
print('python', sys.version.split()[0], '| potluck', potluck.__version__, potluck.__file__)
"

# -- 2. llama.cpp with CUDA, the 7B meanwhile -------------------------------------------------------
NVCC="" CUDA_ROOT=""
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-*; do
  if [[ -n $d && -x $d/bin/nvcc ]]; then NVCC=$d/bin/nvcc; CUDA_ROOT=$d; break; fi
done
if [[ -z $NVCC ]] && command -v nvcc >/dev/null; then
  NVCC=$(command -v nvcc); CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
fi
echo "nvcc: ${NVCC:-none} (CUDA root ${CUDA_ROOT:-?})"; "${NVCC:-nvcc}" --version | tail -2
CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC"
  -DGGML_CUDA="$CUDA" -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON
  -DGGML_BACKEND_DL=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_COMMIT=0c1e570 -DLLAMA_BUILD_NUMBER=1)
# cuBLAS: the toolkit's, else the pip wheels' (torch's nvidia-cublas) or $CUBLAS_ROOT's
if [[ $CUDA == ON ]] && ! find "$CUDA_ROOT"/include "$CUDA_ROOT"/targets/*/include -maxdepth 1 -name cublas_v2.h 2>/dev/null | grep -q .; then
  PURELIB=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  HDR=$(find ${CUBLAS_ROOT:-} "$PURELIB/nvidia" /opt/torch/.venv/lib/python3*/site-packages/nvidia \
    -name cublas_v2.h 2>/dev/null | head -1)
  if [[ -n $HDR ]]; then
    LIB=$(dirname "$(dirname "$HDR")")/lib
    echo "cuBLAS not in the toolkit: using $HDR and $LIB"
    ls "$LIB"
    CMAKE_ARGS+=(-DCUDA_cublas_LIBRARY="$(ls "$LIB"/libcublas.so* | head -1)"
      -DCUDA_cublasLt_LIBRARY="$(ls "$LIB"/libcublasLt.so* | head -1)"
      -DCMAKE_CUDA_FLAGS="-I$(dirname "$HDR")" -DCMAKE_CXX_FLAGS="-I$(dirname "$HDR")")
    export LD_LIBRARY_PATH=$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  else
    echo "cuBLAS: no cublas_v2.h found (toolkit, pip wheels); configure will fail"
  fi
fi
# the driver library for CUDA::cuda_driver when the toolkit has no stub of it
if [[ $CUDA == ON ]] && ! find "$CUDA_ROOT"/lib64 "$CUDA_ROOT"/targets/*/lib -name 'libcuda.so' 2>/dev/null | grep -q .; then
  DRV=$(ldconfig -p | awk '/libcuda\.so(\.1)? /{print $NF; exit}')
  [[ -z $DRV ]] && DRV=$(ls /usr/lib/x86_64-linux-gnu/libcuda.so* /usr/lib64/libcuda.so* \
    /usr/local/nvidia/lib64/libcuda.so* 2>/dev/null | head -1)
  [[ -n $DRV ]] && echo "CUDA driver library: $DRV" && CMAKE_ARGS+=(-DCUDA_cuda_driver_LIBRARY="$DRV")
fi
step configure 120 cmake -S .gpu/llama.cpp -B "$BUILD" "${CMAKE_ARGS[@]}" >"$OUT/build.log" 2>&1
CONF=$?
grep -E "CUDA|cuBLAS|CMake Error|Including|ggml version" "$OUT/build.log" | head -30
[[ ${ONLY_CONFIGURE:-0} == 1 ]] && { echo "ONLY_CONFIGURE: stop"; exit $CONF; }

MODEL=$POTLUCK_CACHE/bench/qwen7b-synthetic-Q4_K_M.gguf
(
  t=$(date +%s)
  timeout 300 python3 bench/make_model.py qwen7b
  echo "=== make_model qwen7b: exit $? in $(($(date +%s) - t)) s"
) >"$OUT/make_model.log" 2>&1 &
MAKE_MODEL=$!

if ((CONF == 0)); then
  step build 400 cmake --build "$BUILD" --target llama-bench -j "$(nproc)" >>"$OUT/build.log" 2>&1
  BUILT=$?
  tail -5 "$OUT/build.log"
else
  BUILT=1
fi
ls -la "$BUILD/bin" 2>/dev/null
ldd "$BUILD/bin/libggml.so" 2>/dev/null | grep -E "ggml|cuda|cublas"

# -- 3. Potluck on that ggml ------------------------------------------------------------------------
if ((BUILT != 0)); then
  echo "=== no CUDA build of ggml: stopping (see build.log)"
  wait $MAKE_MODEL; cat "$OUT/make_model.log"
  exit 1
fi
export POTLUCK_GGML=$BUILD/bin
"$BUILD/bin/llama-bench" --version
step devices 60 python3 -c "
from potluck.model.ggml_lib import devices, version
print(version())
for d in devices(): print(' ', d)
"
step doctor 60 python3 -m potluck.cli doctor --no-mdns --load-seconds 0
step test_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  --deselect tests/test_gpu.py::test_ngl_split_gives_the_cpus_text_until_a_near_tie \
  --deselect tests/test_gpu.py::test_a_stage_too_big_for_the_device_says_how_many_layers_fit \
  --deselect tests/test_gpu.py::test_a_worker_offering_its_gpu_is_planned_with_gpu_layers
# (those three need SmolLM2, which is fetched from PyPI: no network here)
step drop_repro 60 python3 bench/gpu/drop_repro.py tiny 99

step wait_model 200 bash -c "while kill -0 $MAKE_MODEL 2>/dev/null; do sleep 1; done"
cat "$OUT/make_model.log"
ls -la "$MODEL"
THREADS=$(nproc)
step llama_bench 120 "$BUILD/bin/llama-bench" -m "$MODEL" -ngl 99 -p 512 -n 128 -r 3 -t "$THREADS" \
  -o json >"$OUT/llama_bench.json"
python3 -c "
import json
for t in json.load(open('$OUT/llama_bench.json')):
    print(f\"  llama-bench pp{t['n_prompt']} tg{t['n_gen']}: {t['avg_ts']:.1f} ± {t['stddev_ts']:.1f} t/s on {t['gpu_info']} ({t['backends']}, ngl {t['n_gpu_layers']})\")
"
step bench_single 200 python3 bench/bench_single.py --models qwen7b --threads "$THREADS" --reps 1 \
  --pp 512 --tg 128 --ngl 99 --llama-bin "$BUILD/bin" --out /tmp/bench/single.json
cp /tmp/bench/single.json "$OUT/single.json" 2>/dev/null
# the CLI's own -ngl path (one sequence, no drop): prompt and decode tok/s as users see them
step potluck_run 60 python3 -m potluck.cli run -m "$MODEL" -ngl 99 -c 1024 -n 128 --temp 0 --raw \
  --no-mdns "$(python3 -c "print('the quick brown fox ' * 100)")"
# with time left: half the layers on the GPU (the scheduler's CPU/GPU split)
step bench_single_ngl14 150 python3 bench/bench_single.py --models qwen7b --threads "$THREADS" --reps 1 \
  --pp 512 --tg 128 --ngl 14 --llama-bin "$BUILD/bin" --out /tmp/bench/single_ngl14.json
cp /tmp/bench/single_ngl14.json "$OUT/single_ngl14.json" 2>/dev/null
echo "=== done in $(elapsed) s"
