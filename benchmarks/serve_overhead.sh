#!/usr/bin/env bash
# What `fw serve` costs against the offline engine on the same workload: `fw bench throughput` and `fw bench serve`
# (all requests in flight at once, streaming) taken in turns, so that a noisy machine's drift hits both alike.
#   benchmarks/serve_overhead.sh MODEL_DIR [PAIRS]
# Environment: PORT (8011), NUM_PROMPTS (32), INPUT_LEN (128), OUTPUT_LEN (64), FW (the fw executable).
set -euo pipefail

model=${1:?usage: serve_overhead.sh MODEL_DIR [PAIRS]}
pairs=${2:-3}
fw=${FW:-$(command -v fw || true)}
[[ -n $fw ]] || { echo "fw not found: activate its virtualenv or set FW" >&2; exit 1; }
port=${PORT:-8011} n=${NUM_PROMPTS:-32} input_len=${INPUT_LEN:-128} output_len=${OUTPUT_LEN:-64}
vocab=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1] + "/config.json"))["vocab_size"])' "$model")
export OMP_NUM_THREADS=2
out=$(mktemp -d)

"$fw" serve --model "$model" --port "$port" >"$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$out"' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 "$server" 2>/dev/null || { cat "$out/server.log" >&2; exit 1; }
  sleep 2
done
load=(bench serve --base-url "http://127.0.0.1:$port/v1" --num-prompts "$n" --max-concurrency "$n"
      --input-len "$input_len" --random-ids "$vocab")
# The server's warm-up, as `fw bench throughput` has its own: other prompts (seed 1), so no prefix-cache hit.
"$fw" "${load[@]}" --output-len 8 --seed 1 >/dev/null 2>&1
for i in $(seq "$pairs"); do
  "$fw" bench throughput --model "$model" --num-prompts "$n" --input-len "$input_len" --output-len "$output_len" \
    --num-iters 1 --json >"$out/offline_$i.json" 2>/dev/null
  "$fw" "${load[@]}" --output-len "$output_len" --seed $((10 + i)) --json "$out/serve_$i.json" >/dev/null 2>&1
done

python3 - "$out" "$pairs" <<'PY'
import json, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
rows = [(json.load(open(f"{out}/offline_{i}.json"))["output_tokens_per_s"],
         json.load(open(f"{out}/serve_{i}.json"))["output_throughput"]) for i in range(1, pairs + 1)]
print("| pair | offline tok/s | serve tok/s | serve/offline |\n|---|---|---|---|")
for i, (offline, serve) in enumerate(rows, 1):
    print(f"| {i} | {offline:.1f} | {serve:.1f} | {serve / offline:.3f} |")
ratios = [serve / offline for offline, serve in rows]
print(f"| median | {statistics.median(r[0] for r in rows):.1f} | {statistics.median(r[1] for r in rows):.1f} "
      f"| {statistics.median(ratios):.3f} (spread {max(ratios) - min(ratios):.3f}) |")
PY
