#!/usr/bin/env bash
# One GPU session's checks in one call (a device machine is lent for minutes; issue 44 asks for 8): each step below
# runs under its own time budget, writes its rows as they complete, and is packed into $OUT/results.tar.gz as soon as
# it ends, so a time-out loses at most the step it cut short.
#
#   OUT=/some/dir bash bench/gpu_run.sh              # on an H100 / H200 (device tool: OUT is set there)
#   OUT=/some/dir bash bench/gpu_run.sh --dry-run    # on a CPU: every step's --dry-run (tests/test_gpu_run.py)
#
# Steps, in order of what the session most needs (each a row of $OUT/summary.md with its exit status and seconds):
#   1. gpu_check    bench/gpu_check.py: builds the CUDA extension (torch JIT load, cached for the later steps), checks
#                   every kernel against its float64 reference (W4A16 v1, the decode kernel v2 with and without PDL,
#                   dequantize + cuBLAS, fp8 GEMM, our quantize + _scaled_mm, the quantize kernel) under
#                   compute-sanitizer too, and times them single-call and in chain mode against bf16, tinygemm and
#                   _scaled_mm: the kernel bars.                                          budget GPU_CHECK_BUDGET=150 s
#   2. gpu_decode   bench/gpu_decode.py: the Llama-3-8B-shaped decode table under CUDA graphs (bf16, W4A16 v2 / v1 /
#                   tinygemm / dequant+cuBLAS, FP8), batch 1 / 16 / 64: the end-to-end bars. budget GPU_DECODE_BUDGET=130 s
#   3. gpu_recipes  bench/gpu_recipes.py: `compress run` on CUDA, five recipes on a SmolLM2-shaped model against
#                   their CPU runs, then the 7B-shape GPTQ run where the budget allows     budget GPU_RECIPES_BUDGET=150 s
# Each step's own budget ends it; `timeout` adds 60 s of grace for its teardown. The decode kernel v2 is offered to
# the dispatcher here (COMPRESS_W4A16_V2=1): gpu_check is what checks it.
#
# $OUT afterwards (the device tool brings back at most 8 files): summary.md, run.log, results.tar.gz (every step's
# folder: jsonl rows, json, md, logs), and each step's md for a quick read.
# GPU_RUN_EXTRA adds optional steps (below). GPU_CHECK_FAMILIES picks gpu_check's kernel families (default all; the CI dry run takes fp8_quantize to stay short).
set -u
cd "$(dirname "$0")/.."
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; fi
OUT=${OUT:-bench/results/gpu_run}
if [ -n "${GPU_RUN_WORK:-}" ]; then WORK=$GPU_RUN_WORK; else WORK=$(mktemp -d /tmp/gpu_run.XXXXXX); trap 'rm -rf "$WORK"' EXIT; fi
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 COMPRESS_W4A16_V2=1
export COMPRESS_CUDA_BUILD_DIR=${COMPRESS_CUDA_BUILD_DIR:-/tmp/compress_cuda_build}
PY=${PYTHON:-python3}
T0=$(date +%s)

{
  echo "# GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)${DRY:+ (dry run)}"
  echo
  echo "$(nvidia-smi -L 2>/dev/null | head -1 || true)"
  $PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" 2>&1
  echo
  echo "| step | exit | seconds | result |"
  echo "|---|---:|---:|---|"
} > "$OUT/summary.md"
: > "$OUT/run.log"

pack() {  # every finished step's folder, into one file the device tool brings back
  tar -czf "$OUT/results.tar.gz.part" -C "$WORK" . 2>>"$OUT/run.log" && mv "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"
}

step() {  # step NAME BUDGET RESULT_LINE_PATTERN COMMAND...: run it into $WORK/NAME, log, summarise, pack
  local name=$1 budget=$2 pattern=$3
  shift 3
  local dir="$WORK/$name" start rc line
  mkdir -p "$dir"
  start=$(date +%s)
  echo "== $name (budget ${budget} s) at +$((start - T0)) s: $*" >> "$OUT/run.log"
  timeout --kill-after=10 $((budget + 60)) "$@" --out "$dir" $DRY > "$dir/stdout.txt" 2>&1
  rc=$?
  line=$(grep -E "$pattern" "$dir/stdout.txt" | tail -1 | tr '|' '/' | cut -c1-300)
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && line="timed out after $((budget + 60)) s; ${line}"
  echo "| $name | $rc | $(( $(date +%s) - start )) | ${line:-see $name/stdout.txt} |" >> "$OUT/summary.md"
  tail -n 25 "$dir/stdout.txt" >> "$OUT/run.log"
  for md in "$dir"/*.md; do [ -f "$md" ] && cp "$md" "$OUT/"; done
  pack
}

step gpu_check "${GPU_CHECK_BUDGET:-150}" "rows, .* failed" \
  $PY bench/gpu_check.py --budget "${GPU_CHECK_BUDGET:-150}" --families "${GPU_CHECK_FAMILIES:-w4a16,fp8_gemm,fp8_quantize}"
step gpu_decode "${GPU_DECODE_BUDGET:-130}" "^Bars" \
  $PY bench/gpu_decode.py --budget "${GPU_DECODE_BUDGET:-130}"
# the recipes need what the call carries (python bench/gpu_recipes.py --prepare writes .gpu_carry/ here: tokenizer,
# WikiText-2, wheels; the embedded model's GGUF in two halves for a second call, see docs/gpu.md)
# shellcheck disable=SC2086
step gpu_recipes "${GPU_RECIPES_BUDGET:-150}" "^Verdicts" \
  $PY bench/gpu_recipes.py --budget "${GPU_RECIPES_BUDGET:-150}" --models "${GPU_RECIPES_MODELS:-random}" \
  ${GPU_RECIPES_ARGS:-}
# Optional extras, after the three (GPU_RUN_EXTRA="e2e,splits"): the kernels inside small quantized models against
# their reference path per layer (bench/gpu_e2e.py), and version 1's split-K sweep (bench/w4a16_splits.py).
case ",${GPU_RUN_EXTRA:-}," in *,e2e,*)
  step gpu_e2e "${GPU_E2E_BUDGET:-90}" "rel err|Error" $PY bench/gpu_e2e.py ;; esac
case ",${GPU_RUN_EXTRA:-}," in *,splits,*)
  step w4a16_splits "${GPU_SPLITS_BUDGET:-90}" "." $PY bench/w4a16_splits.py --ms 1,16,64 ;; esac
echo "" >> "$OUT/summary.md"
echo "Total $(( $(date +%s) - T0 )) s; every step's files in results.tar.gz." >> "$OUT/summary.md"
cat "$OUT/summary.md"
