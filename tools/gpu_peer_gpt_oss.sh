#!/usr/bin/env bash
# Issue #19's gpt-oss peer comparison in ONE device call: llama.cpp (sm_90) built in the background
# while a gpt-oss-20b geometry with random MXFP4 experts is written (tools/bench_mxfp4.py write) and
# converted by llama.cpp's convert_hf_to_gguf.py (experts stay MXFP4: a 12.83 GiB GGUF); then
# llama-batched-bench / ours (tools/bench_cuda_decode.py) / llama-batched-bench / llama-bench, batch
# 1 and 64, prompt 32 + 64 generated. 250-310 s on an H100 (the build is ~200-260 s of it).
#
# Prepare the carried folder here (PEER, default .gpu/peer; keep it out of git):
#   pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/peer
#   tar xzf /tmp/peer/llama_cpp_python-0.3.36.tar.gz -C /tmp/peer
#   tar cJf $PEER/llama.cpp.tar.xz -C /tmp/peer/llama_cpp_python-0.3.36/vendor --exclude=llama.cpp/docs \
#     --exclude=llama.cpp/models --exclude=llama.cpp/media --exclude=llama.cpp/tests \
#     --exclude=llama.cpp/benches llama.cpp                                          # ~8 MB
#   PYTHONPATH=.:tests python -c "from pathlib import Path; from harmony_tokenizer import \
#     save_harmony_tokenizer as s; s(Path('/tmp/harmony'))"   # the real o200k_harmony (quicktok-v1)
#   tar cJf $PEER/tok.tar.xz -C /tmp/harmony tokenizer.json tokenizer_config.json   # ~3 MB
# Then: run `PEER=.gpu/peer bash tools/gpu_peer_gpt_oss.sh` on the device with carry [".gpu"].
# GPU_TESTS=1 also runs the whole `pytest -m gpu` suite (tools/gpu_tests.sh, ~270 s alone on an H100)
# while llama.cpp builds, and waits for it before any benchmark; its tail goes to $OUT/gpu_tests.log
# and to the output.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; PEER=${PEER:-.gpu/peer}; W=/tmp/peer; mkdir -p "$OUT" "$W"; T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LC=$W/llama.cpp
if [ "${GPU_TESTS:-0}" = 1 ]; then  # the GPU suite beside the build; done before the benchmarks
  (PART=1 PARTS=1 TIMEOUT=${TESTS_TIMEOUT:-380} TAIL=8 bash tools/gpu_tests.sh > $OUT/gpu_tests.log 2>&1) &
  TESTS=$!
fi
if [ ! -x $LC/build/bin/llama-bench ]; then  # a warm machine keeps the build and the GGUF
  tar xJf $PEER/llama.cpp.tar.xz -C $W
  bash tools/build_llama_cuda.sh $LC $W/build.log 420 llama-bench llama-batched-bench &
  BUILD=$!
  timeout 200 python3 tools/bench_mxfp4.py write $W/oss20b --layers 24 --weights 2>&1 | tail -1
  rm -f $W/oss20b/tokenizer* $W/oss20b/special*; tar xJf $PEER/tok.tar.xz -C $W/oss20b
  PYTHONPATH=$LC/gguf-py:$LC timeout 300 python3 $LC/convert_hf_to_gguf.py $W/oss20b --outtype bf16 \
    --outfile $W/oss20b.gguf > $W/convert.log 2>&1; echo "convert rc=$? at $(el)s"
  wait $BUILD; tail -1 $W/build.log; echo "built at $(el)s"
fi
if [ -n "${TESTS:-}" ]; then wait $TESTS; tail -3 $OUT/gpu_tests.log; echo "tests done at $(el)s"; fi
B=$LC/build/bin; G=$W/oss20b.gguf
LB="timeout 90 $B/llama-batched-bench -m $G -ngl 99 -fa on -c 8192 -npp 32 -ntg 64 -npl 1,64"
$LB > $OUT/llama_batched_1.log 2>&1; grep -E "^\|" $OUT/llama_batched_1.log | tail -3
timeout 150 python3 tools/bench_cuda_decode.py --geometry gpt-oss-20b-mxfp4 --batches 1,64 \
  --prompt-len 32 --gen-len 64 --warmup-gen 64 --repeats 2 > $OUT/ours.log 2>&1
grep "^{" $OUT/ours.log | cut -c1-330
$LB > $OUT/llama_batched_2.log 2>&1; grep -E "^\|" $OUT/llama_batched_2.log | tail -2
timeout 60 $B/llama-bench -m $G -ngl 99 -fa 1 -p 0 -n 64 -r 3 > $OUT/llama_bench.log 2>&1
grep -E "^\|" $OUT/llama_bench.log | tail -1; echo "done at $(el)s"
