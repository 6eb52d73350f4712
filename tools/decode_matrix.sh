#!/bin/bash
# Batch-1 (or BATCHES) decode tok/s for several geometry / weight / PDL variants in ONE device call,
# one line each (tools/bench_cuda_decode.py underneath; its full JSON rows go to $OUT/decode.log).
# A spec is GEOMETRY:MODE[:PDL[:LINES]]: GEOMETRY 8b | 1b (llama-8b / llama-1b), MODE bf16 | fp8 |
# int8 | fp8table (fp8 with the tile table in $TABLE, bench_gemv_dot / bench_fp8_linear
# --write-configs format), PDL auto | on | off (TORCH_RUNNER_PDL), LINES the GEMV's L2 prefetch
# under PDL (TORCH_RUNNER_GEMV_PREFETCH_LINES; default: the library's). Compare within one call.
#
#   OUT=/tmp/o SPECS="8b:fp8 8b:bf16 1b:fp8 1b:bf16" REPEATS=2 bash tools/decode_matrix.sh
set -u
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
run() {
  local label=$1; shift
  timeout "${RUN_TIMEOUT:-120}" python3 tools/bench_cuda_decode.py --batches "${BATCHES:-1}" \
    --repeats "${REPEATS:-2}" --new-lengths '' "$@" > "$OUT/run.log" 2>&1
  cat "$OUT/run.log" >> "$OUT/decode.log"
  python3 - "$label" "$OUT/run.log" <<'PY'
import json, sys
label, path = sys.argv[1], sys.argv[2]
rows = [json.loads(line) for line in open(path) if line.startswith("{") and "decode_tok_s" in line]
for r in rows:
    print(label, r["geometry"], "b", r["batch"], "tok/s", r["decode_tok_s"], r["runs"],
          "steady", r["steady_tok_s"], "wGiB", r["weights_gib"], "peak", r["peak_gib"], r["gpu"],
          "tokens", r.get("tokens_sha"))
if not rows:
    print(label, "NO RESULT:", open(path).read()[-600:])
PY
}
for spec in ${SPECS:-8b:fp8 8b:bf16 1b:fp8 1b:bf16}; do
  IFS=: read -r geo mode pdl lines <<< "$spec"
  export TORCH_RUNNER_PDL=${pdl:-auto}
  if [ -n "${lines:-}" ]; then export TORCH_RUNNER_GEMV_PREFETCH_LINES=$lines
  else unset TORCH_RUNNER_GEMV_PREFETCH_LINES; fi
  case $mode in
    bf16) run "$spec" --geometry "llama-$geo" ;;
    fp8 | int8) run "$spec" --geometry "llama-$geo" --quantization "$mode" ;;
    fp8table) run "$spec" --geometry "llama-$geo" --quantization fp8 --gemv-configs "$TABLE" ;;
    *) echo "$spec: MODE must be bf16, fp8, int8 or fp8table" ;;
  esac
done
rm -f "$OUT/run.log"
