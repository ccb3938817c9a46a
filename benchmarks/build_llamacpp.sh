#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize for benchmarks/cpu_vs_llamacpp.py and
# benchmarks/random_gguf.py (K-quants). Source: the llama.cpp that the llama-cpp-python
# sdist on PyPI vendors (PyPI is reachable where GitHub is not).
#
#   benchmarks/build_llamacpp.sh [BUILD_DIR]      # default /work/llamacpp-build
#   LLAMA_JOBS=4 LLAMA_CPP_PYTHON_VERSION=0.3.16 benchmarks/build_llamacpp.sh
#
# The binaries land in BUILD_DIR/build/bin/{llama-server,llama-quantize}.
# AMX is disabled: on this VM the CPU reports AMX but the native build SIGILLs on
# tile instructions (see benchmarks/cpu_vs_llamacpp.py); explicit -mno-* flags win
# over -march=native in gcc. Set LLAMA_AMX=1 to keep the native choice.
set -euo pipefail

root=${1:-/work/llamacpp-build}
jobs=${LLAMA_JOBS:-2}
version=${LLAMA_CPP_PYTHON_VERSION:-}
mkdir -p "$root"
cd "$root"

if ! command -v cmake >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update && apt-get install -y cmake
    else
        python3 -m pip install --user cmake
        export PATH="$HOME/.local/bin:$PATH"
    fi
fi

if [ ! -d src/vendor/llama.cpp ]; then
    spec=llama-cpp-python${version:+==$version}
    rm -rf sdist src && mkdir -p sdist src
    python3 -m pip download --no-deps --no-binary :all: -d sdist "$spec"
    tar -xzf sdist/llama_cpp_python-*.tar.gz -C src --strip-components=1
fi

flags=""
if [ "${LLAMA_AMX:-0}" != 1 ]; then
    flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags"
cmake --build build --target llama-server llama-quantize -j"$jobs"
ls -l build/bin/llama-server build/bin/llama-quantize
