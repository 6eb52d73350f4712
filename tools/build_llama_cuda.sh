#!/usr/bin/env bash
# Build llama.cpp's CUDA (sm_90) binaries, the GPU peer of tools/gpu_peer_bench.sh and
# tools/gpu_peer_gpt_oss.sh: `bash tools/build_llama_cuda.sh LLAMA_DIR LOG SECONDS TARGET...`.
# cmake + ninja with 15 jobs, at most SECONDS; the output goes to LOG, ending "build rc=N".
set -u
dir=$1 log=$2 limit=$3; shift 3
(cd "$dir" && timeout "$limit" bash -c "cmake -B build -G Ninja -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null && \
  cmake --build build -j15 --target $*") > "$log" 2>&1
echo "build rc=$?" >> "$log"
