#!/usr/bin/env bash
# The GPU half of the test suite and the issue-4 benchmarks, in one go (a device call is short and costly).
#   scripts/gpu_suite.sh [tests] [bench]     (default: both); results under $OUT (default bench/out)
# Each benchmark writes JSON with the GPU's name and its own command; copy them into bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
if ! python3 -c "import pdserve.core" 2>/dev/null; then
  links=$(mktemp -d)  # a GPU host without pdserve installed
  bash scripts/package_links.sh "$links"
  export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}"
fi
stages=${*:-tests bench}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
for stage in $stages; do
  case $stage in
    tests)
      python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests \
        --junitxml "$OUT/gpu_tests.xml" >"$OUT/gpu_tests.log" 2>&1 || status=1
      tail -25 "$OUT/gpu_tests.log" ;;
    bench)
      python3 scripts/bench_prefill.py --profile --out "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1 || status=1; tail -60 "$OUT/prefill.log"
      python3 scripts/bench_decode.py --profile --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1 || status=1; tail -40 "$OUT/decode.log"
      python3 scripts/bench_handoff.py --sweep --out "$OUT/handoff.json" 2>&1 | tail -15 || status=1 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $status
