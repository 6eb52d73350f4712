#!/usr/bin/env bash
# Issue #19 peer comparison in ONE device call: builds llama.cpp (sm_90) in the background while
# our server and decode benchmarks run, then the same checks on llama.cpp with the same weights.
# Run from the .gpu_peer copy: bash tools/gpu_peer_bench.sh (needs llama.cpp.tar.xz, tok.tar.xz,
# whl/ beside it: fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection
# AND opentelemetry-api + importlib_metadata (fastapi 0.165 imports opentelemetry; the 2026-12-02 call
# lacked it, so our server did not start); every step has its own timeout so $OUT gets JSON/PNG/logs even if a late one fails).
set -u
OUT=${OUT:-/tmp/out}; W=/tmp/peer; mkdir -p "$OUT" "$W"; T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/steps.log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site whl/*.whl ../.whl/*.whl
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
tar xJf llama.cpp.tar.xz -C "$W"; LC=$W/llama.cpp
bash tools/build_llama_cuda.sh "$LC" "$W/build.log" 430 llama-bench llama-server llama-batched-bench &
BUILD=$!
log "build started; writing the checkpoint"
M=$W/llama1b; mkdir -p "$M"; tar xJf tok.tar.xz -C "$M"
timeout 120 python3 - "$M" <<'PY' 2>&1 | tail -3 | tee -a "$OUT/steps.log"
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
sys.path.insert(0, "tools"); from bench_cuda_decode import COMMON, GEOMETRIES
cfg = {"max_position_embeddings": 8192, **COMMON, **GEOMETRIES["llama-1b"]}
cfg |= dict(bos_token_id=128000, eos_token_id=128001)  # the real Llama-3 tokenizer's ids
config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")})
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
for p in model.parameters():  # small random weights (std 0.02) so logits stay finite
    torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
model.save_pretrained(sys.argv[1]); print("saved", sum(p.numel() for p in model.parameters()))
PY
log "checkpoint: $(du -sh $M | cut -f1)"
(PYTHONPATH=$LC/gguf-py:/tmp/site timeout 150 python3 $LC/convert_hf_to_gguf.py "$M" --outtype bf16 \
  --outfile $W/llama1b.gguf >"$W/convert.log" 2>&1; echo "convert rc=$?" >>"$W/convert.log") &
CONV=$!
SV="--input-len 32 256 --output-len 32 128 --num-prompts 64 --seed 0 --concurrency 1 16 64"
log "ours: bench_serving"
timeout 170 python3 tools/bench_serving.py --model "$M" --device cuda --server-arg=--max-num-seqs --server-arg=64 $SV --out "$OUT/serving_ours.json" \
  --plot "$W/ours.png" > "$W/serving_ours.log" 2>&1; log "ours serving rc=$?"
log "ours: bench_cuda_decode"
timeout 110 python3 tools/bench_cuda_decode.py --geometry llama-1b --batches 1,64 --repeats 3 \
  --new-lengths 301,517,777 > "$W/decode_ours.log" 2>&1; log "ours decode rc=$?"
wait $CONV; tail -2 "$W/convert.log" | tee -a "$OUT/steps.log"
log "waiting for the build"; wait $BUILD; tail -3 "$W/build.log" | tee -a "$OUT/steps.log"
B=$LC/build/bin; G=$W/llama1b.gguf
if [ -x $B/llama-server ] && [ -f $G ]; then
  $B/llama-server -m $G -ngl 99 --parallel 64 -c 49152 -cb --port 8080 --host 127.0.0.1 \
    > "$W/llama_server.log" 2>&1 &
  LS=$!
  for i in $(seq 120); do curl -sf http://127.0.0.1:8080/health >/dev/null && break; sleep 0.5; done
  log "llama-server up; bench_serving"
  timeout 150 python3 tools/bench_serving.py --base-url http://127.0.0.1:8080 $SV \
    --out "$OUT/serving_llamacpp.json" --plot "$W/llama.png" > "$W/serving_llama.log" 2>&1
  log "llama serving rc=$?"; kill $LS
fi
[ -x $B/llama-batched-bench ] && timeout 60 $B/llama-batched-bench -m $G -ngl 99 -fa on -c 20000 \
  -npp 128 -ntg 128 -npl 1,8,64 > "$W/batched_bench.log" 2>&1; log "batched-bench rc=$?"
[ -x $B/llama-bench ] && timeout 50 $B/llama-bench -m $G -ngl 99 -p 512 -n 128 -r 3 -o json \
  > "$W/llama_bench.json" 2>"$W/llama_bench.err"; log "llama-bench rc=$?"
python3 tools/bench_serving.py --help >/dev/null 2>&1
python3 - "$OUT" "$W" <<'PY' || true
import json, sys, pathlib
out, w = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = {}
for name in ("ours", "llamacpp"):
    p = out / f"serving_{name}.json"
    if p.exists():
        rows[name] = [{k: r[k] for k in ("concurrency", "completed", "output_throughput", "ttft_ms",
                       "tpot_ms", "itl_ms")} for r in json.loads(p.read_text())["runs"]]
print(json.dumps(rows, indent=0))
PY
for f in ours.png llama.png; do [ -f $W/$f ] && cp $W/$f $OUT/; done
tar czf "$OUT/logs.tgz" -C "$W" --exclude=llama.cpp --exclude=llama1b --exclude='*.gguf' . 2>/dev/null
tail -4 "$W/serving_ours.log" "$W/decode_ours.log" "$W/batched_bench.log" 2>/dev/null | cut -c1-300
log "done"
