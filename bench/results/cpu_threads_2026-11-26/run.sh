#!/bin/bash
# A/B of --cpu-threads: "auto" (the launcher's default share of the cores) vs "torchdefault" (--cpu-threads 0): 2+2 SmolLM2
# CPU cluster, 128 random prompts of 128 tokens, 64 output tokens, concurrency 64. Usage: run.sh auto torchdefault
cd "$(dirname "$0")/../../.."; . .venv/bin/activate
M=$(pdserve-prepare-model | tail -n 1)
for mode in "$@"; do
  run=/tmp/ab-$mode; rm -rf $run
  extra=(); [ "$mode" = torchdefault ] && extra=(--cpu-threads 0)
  pdserve-cluster --model $M --prefill 2 --decode 2 --port 50600 --run-dir $run --metrics-port -1 --num-blocks 1024 "${extra[@]}" > $run.out 2>&1 &
  pid=$!
  for i in $(seq 120); do grep -q "cluster ready" $run.out && break; sleep 1; done
  pdserve-bench-serving --address 127.0.0.1:50600 --dataset random --num-prompts 128 --input-len 128 --output-len 64 --max-concurrency 64 --model-dir $M --ignore-eos --no-progress --result-json /tmp/ab-$mode.json > /tmp/ab-$mode.bench 2>&1
  kill -TERM $pid; wait $pid
  echo "== $mode"; grep -i "throughput\|TTFT\|TPOT\|duration\|failed\|Successful" /tmp/ab-$mode.bench | head -12
done
