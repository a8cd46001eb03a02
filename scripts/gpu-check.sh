#!/usr/bin/env bash
# Runs every GPU test of the repository (pytest -m cuda) on a CUDA machine: the one prepared device check.
#   scripts/gpu-check.sh            log also goes to $OUT/gpu-check.log when OUT is set
# Safe to rerun: the venv ($VENV, outside the checkout by default) is reused; satisfied installs are skipped.
# Offline machines: carry wheels and export PIP_FIND_LINKS=<dir> PIP_NO_INDEX=1 (pip reads both).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-${TMPDIR:-/tmp}/fw-gpu-venv}
LOG=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && LOG=$OUT/gpu-check.log; fi

{
  # System site packages: a CUDA torch already on the machine is used instead of downloading another.
  [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
  PY=$VENV/bin/python
  "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null || "$PY" -m pip install -q torch
  "$PY" -c 'import flashinfer' 2>/dev/null || "$PY" -m pip install -q flashinfer-python
  "$PY" -m pip install -q ".[test,flashinfer]"
  # Not the flash-attn extra: without a prebuilt wheel for this torch/CUDA it compiles for far longer than a check
  # may take. Its tests run where it is already installed and skip, saying why, where it is not.
  nvidia-smi
  # Importing flashinfer here makes a broken install fail loudly instead of skipping its tests.
  "$PY" -c 'import sys, torch, flashinfer
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| flashinfer", flashinfer.__version__, "|", torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
  SUMMARY=()
  step() {  # step NAME COMMAND...: run it, time it, keep going on failure, remember the outcome for the table
    local name=$1 start=$SECONDS status=ok; shift
    echo "=== $name"
    "$@" || status="FAILED ($?)"
    SUMMARY+=("$(printf '%-44s %-12s %5ss' "$name" "$status" $((SECONDS - start)))")
  }
  # Every test marked cuda: plugin kernels against the CPU or a dense reference, end to end on the GPU.
  # One process (-n 0): the GPU tests share one device and were verified serially.
  step "pytest -m cuda" "$PY" -m pytest -n 0 -m cuda -v -rs
  # The conformance suites run on the GPU for each plugin that declares CUDA (torch, triton, flashinfer,
  # flashinfer_mla, flash_attn; every quant plugin); compiled Triton, not the interpreter.
  step "conformance suites on cuda" env -u TRITON_INTERPRET "$PY" -m pytest -n 0 -v -rs tests/test_conformance.py \
    -k "Attention or Quant"
  # A short serving measurement per attention backend, on a small random model in bfloat16 (head size 64, which
  # FlashInfer takes).
  MODEL=${TMPDIR:-/tmp}/fw-gpu-check-qwen2
  "$PY" -c "from fw.testing.models import make_tiny_model as m
m('Qwen2ForCausalLM', '$MODEL', dtype='bfloat16', hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
  head_dim=64)"
  for attention in torch triton flashinfer; do
    step "bench latency --attention $attention" "$PY" -m fw_cli bench latency --model "$MODEL" --device cuda \
      --attention "$attention" --input-len 64 --output-len 32 --num-iters 2
    step "bench throughput --attention $attention" "$PY" -m fw_cli bench throughput --model "$MODEL" \
      --device cuda --attention "$attention" --input-len 64 --output-len 32 --num-prompts 32
  done
  echo "=== summary"
  printf '%s\n' "${SUMMARY[@]}"
} 2>&1 | tee "$LOG"
