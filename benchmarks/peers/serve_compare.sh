#!/usr/bin/env bash
# fw serve against vLLM's OpenAI server on one checkpoint: the same streaming load on each, one server at a time.
#   benchmarks/peers/serve_compare.sh MODEL_DIR [OUT_DIR]
# Environment: PORT (8000), NUM_PROMPTS (32, all in flight at once), INPUT_LEN / OUTPUT_LEN (128 each),
# FW (the fw executable; default: the one on PATH), FW_PEERS_DIR (where setup.sh put vLLM).
set -euo pipefail

model=${1:?usage: serve_compare.sh MODEL_DIR [OUT_DIR]}
out=${2:-serve_results}
here=$(cd "$(dirname "$0")" && pwd)
root=${FW_PEERS_DIR:-$HOME/.cache/fw-peers}
fw=${FW:-$(command -v fw || true)}
[[ -n $fw ]] || { echo "fw not found: activate its virtualenv or set FW" >&2; exit 1; }
port=${PORT:-8000} n=${NUM_PROMPTS:-32} input_len=${INPUT_LEN:-128} output_len=${OUTPUT_LEN:-128}
# Prompts are random token ids, as in the offline benches, so that both servers see the same tokens.
vocab=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1] + "/config.json"))["vocab_size"])' "$model")
export OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1
bash "$here/setup.sh" vllm
mkdir -p "$out"

server=
stop() {
  [[ -z $server ]] && return
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  server=
}
trap stop EXIT

serve_and_bench() {  # name, server command...
  local name=$1 deadline=$((SECONDS + 600))
  shift
  if curl -s "http://127.0.0.1:$port/health" >/dev/null; then
    echo "something already serves on port $port: stop it or set PORT" >&2
    exit 1
  fi
  "$@" >"$out/$name.log" 2>&1 &
  server=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "$server" 2>/dev/null || { echo "$name exited; see $out/$name.log" >&2; exit 1; }
    ((SECONDS < deadline)) || { echo "$name not healthy after 600 s; see $out/$name.log" >&2; exit 1; }
    sleep 2
  done
  local load=(bench serve --base-url "http://127.0.0.1:$port/v1" --num-prompts "$n" --max-concurrency "$n"
              --input-len "$input_len" --random-ids "$vocab")
  # Warm-up with other prompts (seed 1), so the timed run gets no prefix-cache hit.
  "$fw" "${load[@]}" --output-len 8 --seed 1 >/dev/null
  echo "== $name"
  "$fw" "${load[@]}" --output-len "$output_len" --json "$out/$name.json"
  stop
}

serve_and_bench fw "$fw" serve --model "$model" --port "$port"
# As vllm_peer.py: vLLM's recommended tcmalloc and Intel OpenMP preloads where they exist, unless LD_PRELOAD is set.
preload=()
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$root/vllm/venv/lib/libiomp5.so"; do
  if [[ -e $lib ]]; then preload+=("$lib"); fi
done
serve_and_bench vllm env "LD_PRELOAD=${LD_PRELOAD-$(IFS=:; echo "${preload[*]}")}" "$root/vllm/venv/bin/python" \
  -m vllm.entrypoints.openai.api_server --model "$model" --port "$port" --dtype bfloat16 --seed 0

python3 - "$out" "$((n * output_len))" <<'PY'
import json, sys
out, expected = sys.argv[1], int(sys.argv[2])
rows = {name: json.load(open(f"{out}/{name}.json")) for name in ("fw", "vllm")}
keys = ["output_throughput", "ttft_ms_p50", "tpot_ms_p50", "e2e_ms_p50"]
print("\n| server | " + " | ".join(keys) + " | output tokens |\n|" + "---|" * (len(keys) + 2))
for name, r in rows.items():
    print(f"| {name} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + f" | {r['output_tokens']} of {expected} |")
print("| fw/vllm | " + " | ".join(f"{rows['fw'][k] / rows['vllm'][k]:.2f}" for k in keys) + " | |")
PY
