#!/usr/bin/env bash
# Make the tiny plain models, every reference checkpoint and its reference dump, one after another.
# Usage: bash make_all.sh [ROOT]   (default ROOT=/tmp/quant_refs; plain models go to ROOT/plain)
# Needs: /work/venv (fw dev venv, for make_tiny_model) and /work/refvenv (reference venv, see README.md).
set -uo pipefail

ROOT=${1:-/tmp/quant_refs}
HERE=$(cd "$(dirname "$0")" && pwd)
DEV_PY=${DEV_PY:-/work/venv/bin/python}
REF_PY=${REF_PY:-/work/refvenv/bin/python}
export HF_HUB_OFFLINE=1
mkdir -p "$ROOT/plain" "$ROOT/logs"
TIMES="$ROOT/timings.tsv"
[ -f "$TIMES" ] || printf 'name\tstep\trc\twall_s\n' >"$TIMES"

# plain name | architecture | make_tiny_model overrides
# The *-hd32 models (head_dim 32, so k/v_proj have 64 outputs) exist for AWQ: GPTQModel's AWQ clip search asserts
# out_features % 64 == 0 for every linear but q/k_proj, which the standard tiny shapes (v_proj: 32 outputs) fail.
# qwen2moe-allmoe: GPTQModel's Qwen2-MoE definition cannot quantize the dense layer that mlp_only_layers=[1] makes.
PLAINS=(
  "llama|LlamaForCausalLM|"
  "qwen2|Qwen2ForCausalLM|"
  "mixtral|MixtralForCausalLM|"
  "qwen2moe|Qwen2MoeForCausalLM|"
  "llama-hd32|LlamaForCausalLM|head_dim=32"
  "qwen2-hd32|Qwen2ForCausalLM|head_dim=32"
  "mixtral-hd32|MixtralForCausalLM|head_dim=32"
  "qwen2moe-allmoe|Qwen2MoeForCausalLM|mlp_only_layers=[]"
  "qwen2moe-allmoe-hd32|Qwen2MoeForCausalLM|mlp_only_layers=[], head_dim=32, moe_intermediate_size=64"
)
for p in "${PLAINS[@]}"; do
  IFS='|' read -r short arch overrides <<<"$p"
  [ -f "$ROOT/plain/$short/model.safetensors" ] && continue
  "$DEV_PY" -c "from pathlib import Path; from fw.testing.models import make_tiny_model; make_tiny_model('$arch', Path('$ROOT/plain/$short'), $overrides)"
done

# name | plain | produce flags
VARIANTS=(
  "llama-gptq-w4-g32-sym|llama|--method gptq --bits 4 --group-size 32 --sym --no-desc-act"
  "llama-gptq-w4-g32-asym-descact|llama|--method gptq --bits 4 --group-size 32 --no-sym --desc-act"
  "llama-gptq-w8-g64-asym-descact|llama|--method gptq --bits 8 --group-size 64 --no-sym --desc-act"
  "llama-gptq-w4-gall-sym|llama|--method gptq --bits 4 --group-size -1 --sym --no-desc-act"
  "llama-gptq-w4-g32-sym-notruesequential|llama|--method gptq --bits 4 --group-size 32 --sym --no-desc-act --no-true-sequential"
  "llama-gptq-w4-g32-asym-lmhead|llama|--method gptq --bits 4 --group-size 32 --no-sym --no-desc-act --lm-head"
  "llama-awq-w4-g32|llama-hd32|--method awq --bits 4 --group-size 32 --no-sym"
  "llama-awq-w4-g64|llama-hd32|--method awq --bits 4 --group-size 64 --no-sym"
  "qwen2-gptq-w4-g32-asym-descact|qwen2|--method gptq --bits 4 --group-size 32 --no-sym --desc-act"
  "qwen2-gptq-w8-g32-sym|qwen2|--method gptq --bits 8 --group-size 32 --sym --no-desc-act"
  "qwen2-awq-w4-g32|qwen2-hd32|--method awq --bits 4 --group-size 32 --no-sym"
  "mixtral-gptq-w4-g32-sym|mixtral|--method gptq --bits 4 --group-size 32 --sym --no-desc-act"
  "mixtral-awq-w4-g32|mixtral-hd32|--method awq --bits 4 --group-size 32 --no-sym"
  "qwen2moe-gptq-w4-g32-asym|qwen2moe-allmoe|--method gptq --bits 4 --group-size 32 --no-sym --no-desc-act"
  "qwen2moe-awq-w4-g32|qwen2moe-allmoe-hd32|--method awq --bits 4 --group-size 32 --no-sym"
)

timed() {  # name step cmd...
  local name=$1 step=$2; shift 2
  local t0 t1 rc
  t0=$(date +%s.%N)
  "$@" >"$ROOT/logs/$name.$step.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  printf '%s\t%s\t%s\t%.1f\n' "$name" "$step" "$rc" "$(echo "$t1 - $t0" | bc)" | tee -a "$TIMES"
  return $rc
}

ONLY=${ONLY:-}  # e.g. ONLY='llama-awq' runs the variants whose name contains it
for v in "${VARIANTS[@]}"; do
  IFS='|' read -r name plain flags <<<"$v"
  [[ -n "$ONLY" && "$name" != *"$ONLY"* ]] && continue
  # shellcheck disable=SC2086
  timed "$name" produce "$REF_PY" "$HERE/reference.py" produce --plain "$ROOT/plain/$plain" --out "$ROOT/$name" $flags \
    && timed "$name" reference "$REF_PY" "$HERE/reference.py" reference --model "$ROOT/$name" --out "$ROOT/$name/reference.safetensors"
done
