#!/usr/bin/env bash
# Disaggregated prefill/decode against one colocated instance (issue 19's serving benchmark): the same streaming
# load of mixed long prompts and long generations through `fw router` in front of a prefill and a decode
# `fw serve` (KV moved by a connector), then straight at one `fw serve`.
#   benchmarks/disagg_serve.sh MODEL_DIR [OUT_DIR]
# Environment: CONNECTOR (p2p), NUM_PROMPTS (32, all in flight), INPUT_LEN (512) / OUTPUT_LEN (128), each
# drawn within +-50%, THREADS (torch threads of the colocated instance; each disaggregated instance gets half).
set -euo pipefail

model=${1:?usage: disagg_serve.sh MODEL_DIR [OUT_DIR]}
out=${2:-disagg_results}
connector=${CONNECTOR:-p2p} n=${NUM_PROMPTS:-32} input_len=${INPUT_LEN:-512} output_len=${OUTPUT_LEN:-128}
threads=${THREADS:-$(nproc)}
half=$(((threads + 1) / 2))
vocab=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1] + "/config.json"))["vocab_size"])' "$model")
base=8100
mkdir -p "$out"

pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop EXIT

start() {  # name, port, command...
  local name=$1 port=$2 deadline=$((SECONDS + 600))
  shift 2
  "$@" --port "$port" >"$out/$name.log" 2>&1 &
  pids+=($!)
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "$name exited; see $out/$name.log" >&2; exit 1; }
    ((SECONDS < deadline)) || { echo "$name not healthy after 600 s; see $out/$name.log" >&2; exit 1; }
    sleep 1
  done
}

bench() {  # name, port
  local load=(bench serve --base-url "http://127.0.0.1:$2/v1" --num-prompts "$n" --max-concurrency "$n"
              --input-len "$input_len" --output-len "$output_len" --random-range-ratio 0.5 --random-ids "$vocab")
  fw "${load[@]}" --num-prompts 4 --output-len 4 --seed 1 >/dev/null  # warm-up, other prompts: no cache hits
  echo "== $1"
  fw "${load[@]}" --json "$out/$1.json"
}

serve=(fw serve --model "$model")
start colocated $base env OMP_NUM_THREADS="$threads" "${serve[@]}"
bench colocated $base
stop

side=$((base + 10))
start prefill $((base + 1)) env OMP_NUM_THREADS="$half" "${serve[@]}" --kv-connector "$connector" \
  --plugin-option kv_connector.role=producer --plugin-option kv_connector.port=$side
start decode $((base + 2)) env OMP_NUM_THREADS="$half" "${serve[@]}" --kv-connector "$connector" \
  --plugin-option kv_connector.role=consumer --plugin-option kv_connector.peer=127.0.0.1:$side
start router $base fw router --prefill http://127.0.0.1:$((base + 1)) --decode http://127.0.0.1:$((base + 2))
bench disaggregated $base
stop

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = {name: json.load(open(f"{out}/{name}.json")) for name in ("colocated", "disaggregated")}
keys = ["ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "output_throughput"]
print("\n| serving | " + " | ".join(keys) + " | completed |\n|" + "---|" * (len(keys) + 2))
for name, r in rows.items():
    print(f"| {name} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + f" | {r['completed']} of {r['num_prompts']} |")
PY
