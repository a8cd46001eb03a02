"""Turn one checkpoint made by reference.py into a small test fixture (run with fw's venv):

    python benchmarks/quant_refs/fixture.py /tmp/quant_refs/llama-gptq-w4-g32-asym-descact plugins/quant/gptq/tests/data/quant_refs/

keeps the checkpoint files and, of reference.safetensors, the prompts, log-probabilities and greedy tokens; each
dequantized weight becomes its SHA-256 (of the float32 bytes) in the metadata key ``weight_sha256``, which
plugins/quant/gptq/tests/test_quant_int.py compares with fw's decoded weights."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

KEEP = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def main(src: Path, dest_root: Path) -> Path:
    dest = dest_root / src.name
    dest.mkdir(parents=True, exist_ok=True)
    for name in KEEP:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    reference = load_file(str(src / "reference.safetensors"))
    metadata = safe_open(str(src / "reference.safetensors"), "pt").metadata()
    weights = {k.removesuffix(".weight"): hashlib.sha256(v.float().contiguous().numpy().tobytes()).hexdigest()
               for k, v in reference.items() if k.endswith(".weight")}
    rest = {k: v.contiguous() for k, v in reference.items() if not k.endswith(".weight")}
    keep = {k: metadata[k] for k in ("linear_compute", "compute_dtype", "versions", "kernels") if k in metadata}
    save_file(rest, str(dest / "reference.safetensors"), metadata={**keep, "weight_sha256": json.dumps(weights)})
    return dest


if __name__ == "__main__":
    print(main(Path(sys.argv[1]), Path(sys.argv[2])))
