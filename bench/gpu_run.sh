#!/usr/bin/env bash
# One GPU session's checks in one call (the device machine is lent for minutes): the kernel check, then the W4A16
# split-K sweep at the default build with the L2 flushed by reads (as gpu_check times) and by writes (as the first
# runs did), the kernels inside models, and, when W4A16_VARIANTS is set, at tuning builds of the split-K blocks (w4a16.cu's macros).
#   OUT=/some/dir bash bench/gpu_run.sh
#   OUT=/some/dir W4A16_VARIANTS="2 6|4 4" bash bench/gpu_run.sh     # "NS STAGES" pairs, |-separated
# writes gpu_check.{json,md,log}, w4a16_splits.json, w4a16_splits_write.json, gpu_e2e.{json,log} (the kernels in
# quantized random-weight models, bench/gpu_e2e.py), and w4a16_splits_variants.json with W4A16_VARIANTS
set -u
OUT=${OUT:-bench/results/gpu_check}
mkdir -p "$OUT" /tmp/w4a16_sweeps
export PYTHONUNBUFFERED=1 COMPRESS_CUDA_BUILD_DIR=/tmp/cb_default
python3 bench/gpu_check.py --budget "${GPU_CHECK_BUDGET:-300}" --out "$OUT" > "$OUT/gpu_check_stdout.txt" 2>&1
echo "gpu_check exit $?"
grep -E "FAILED|bars:|rows," "$OUT/gpu_check_stdout.txt"
rm -f "$OUT/gpu_check.jsonl" "$OUT/gpu_check_stdout.txt"  # the .json holds every row
python3 bench/w4a16_splits.py --ms 1,4,16,32,64,128 --out "$OUT"
python3 bench/w4a16_splits.py --flush write --tag write --ms 1,16 --out "$OUT"
timeout "${E2E_TIMEOUT:-150}" python3 bench/gpu_e2e.py --out "$OUT" > "$OUT/gpu_e2e.log" 2>&1
echo "gpu_e2e exit $?"; grep -E "rel err|Error" "$OUT/gpu_e2e.log"
if [ -n "${W4A16_VARIANTS:-}" ]; then
  IFS='|' read -ra variants <<< "$W4A16_VARIANTS"
  for v in "${variants[@]}"; do
    set -- $v
    COMPRESS_CUDA_FLAGS="-DCOMPRESS_W4A16_SPLIT_NS=$1 -DCOMPRESS_W4A16_SPLIT_STAGES=$2" \
      COMPRESS_CUDA_BUILD_DIR=/tmp/cb_ns$1_st$2 python3 bench/w4a16_splits.py --tag "ns$1_st$2" --ms 1,16 \
      --out /tmp/w4a16_sweeps
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
runs = {p.stem.removeprefix("w4a16_splits_"): json.loads(p.read_text())
        for p in pathlib.Path("/tmp/w4a16_sweeps").glob("*.json")}
pathlib.Path(sys.argv[1], "w4a16_splits_variants.json").write_text(json.dumps(runs, indent=1))
PY
fi
