# kill -9 of each worker of a 1P+1D Llama-8B-shape cluster (dummy bf16 weights) on one GPU, with CUDA graphs and
# with --enforce-eager: seconds to its new process's first heartbeat and the ready line's phases. Run from the repo root
# on the GPU host (wheels from ../shared/gpu-host/prepare.sh in .whl): bash bench/results/restart_h200_2026-11-26/run.sh
pkill -9 -f "pdserve\.(router|prefill_worker|decode_worker)"; for d in /tmp/gpurestart-run*/mps/pipe; do [ -d $d ] && (echo quit | CUDA_MPS_PIPE_DIRECTORY=$d nvidia-cuda-mps-control); done; sleep 2; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash scripts/package_links.sh /tmp/pkg >/dev/null
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 scripts/make_bench_model.py --shape llama-8b --out /tmp/llama8b > /dev/null || exit 1
timeout 280 python3 bench/results/restart_h200_2026-11-26/measure.py /tmp/llama8b $OUT/restart_graphs.json > $OUT/graphs.log 2>&1; echo "graphs rc $?"; tail -5 $OUT/graphs.log
pkill -9 -f "pdserve\.(router|prefill_worker|decode_worker)"; sleep 3; timeout 200 python3 bench/results/restart_h200_2026-11-26/measure.py /tmp/llama8b $OUT/restart_eager.json --enforce-eager > $OUT/eager.log 2>&1; echo "eager rc $?"; tail -5 $OUT/eager.log
cp /tmp/gpurestart-run/logs/*.log $OUT/ 2>/dev/null
