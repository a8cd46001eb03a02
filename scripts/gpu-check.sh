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
  "$PY" -m pytest -m cuda -v
} 2>&1 | tee "$LOG"
