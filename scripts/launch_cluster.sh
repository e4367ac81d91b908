#!/usr/bin/env bash
# Starts a pdserve cluster: router + N prefill + M decode workers under per-role supervision.
#   scripts/launch_cluster.sh [--model DIR] [--prefill N] [--decode M] [--device cuda|cpu] [--port P] [flags...]
#   scripts/launch_cluster.sh --colocated [--decode M] ...   one process per GPU share doing prefill and decode
#   scripts/launch_cluster.sh --prefill-tp 2 --decode-tp 2 --prefill-gpus 0,1 --decode-gpus 2,3 ...   TP groups
#   scripts/launch_cluster.sh --plan PROFILE --workload NAME --slo ttft:MS,tpot:MS [flags...]   the layout pdserve-plan
#       recommends for that GPU profile, workload and SLO (docs/planner.md); flags given here override the plan's
#   scripts/launch_cluster.sh status [--run-dir DIR] [--json]   the processes of a running cluster (pdserve-status)
# On a fresh machine it first creates .venv, installs pdserve and converts the bundled SmolLM2-135M-Instruct.
# Flags: pdserve-cluster --help (router/cluster_cli.py); a router or worker flag reaches the processes that take it.
# Prints one line when the cluster serves (the gRPC address and the OpenAI-compatible HTTP URL); Ctrl-C / SIGTERM
# stops every process.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "${1:-}" = status ]; then  # NOTE: before setup: a cluster that runs has its .venv
  shift
  exec "$root/.venv/bin/pdserve-status" "$@"
fi
bash "$root/scripts/setup_env.sh" >&2
py="$root/.venv/bin/python"
model=""
device=""
plan=""
workload=""
slo=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --plan) plan="$2"; shift 2 ;;
    --workload) workload="$2"; shift 2 ;;
    --slo) slo="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -n "$plan$workload$slo" ]; then
  if [ -z "$plan" ] || [ -z "$workload" ] || [ -z "$slo" ]; then
    echo "launch_cluster.sh: --plan PROFILE, --workload NAME and --slo ttft:MS,tpot:MS go together" >&2
    exit 2
  fi
  planned=$("$root/.venv/bin/pdserve-plan" --profile "$plan" --workload "$workload" --slo "$slo" --launch-flags)
  mapfile -t planned_flags <<< "$planned"
  echo "launch_cluster.sh: pdserve-plan's layout for $workload under $slo: ${planned_flags[*]}" >&2
  args=("${planned_flags[@]}" ${args[@]+"${args[@]}"})  # NOTE: a flag given here comes later and wins
fi
if [ -z "$model" ]; then
  model=$("$root/.venv/bin/pdserve-prepare-model" | tail -n 1)
fi
if [ -z "$device" ]; then
  device=$("$py" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
fi
exec "$root/.venv/bin/pdserve-cluster" --model "$model" --device "$device" ${args[@]+"${args[@]}"}
