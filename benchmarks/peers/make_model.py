"""Write the benchmark checkpoint: Qwen2-0.5B's shape (or 1.5B's) with seeded random weights, bf16 safetensors.

Random weights keep the model hub out of it, and every engine computes the same function on it. The
tokenizer is fw's small test BPE (the offline workloads feed token ids), its vocabulary padded to the
model's: a random model emits any of 151,936 ids, and an id without text would make a streaming server
send no chunk for it, leaving a serving benchmark nothing to time.

    python benchmarks/peers/make_model.py /tmp/qwen05b
    python benchmarks/peers/make_model.py --shape 1.5b /tmp/qwen15b   # weights that dwarf the head and caches
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from fw.testing.models import write_tokenizer


def pad_vocabulary(path: Path, size: int) -> None:
    """Give ids up to ``size`` a text (" w123"): vocabulary entries without merges, so encoding never picks them."""
    file = path / "tokenizer.json"
    data = json.loads(file.read_text(encoding="utf-8"))
    assert not data["model"].get("ignore_merges"), "a whole-word lookup would reach the padding"
    vocab = data["model"]["vocab"]
    start = 1 + max([*vocab.values(), *(t["id"] for t in data["added_tokens"])])
    padding = {f"\u0120w{i}": i for i in range(start, size)}  # \u0120: byte-level BPE's space
    assert not padding.keys() & vocab.keys()
    vocab.update(padding)
    file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# Qwen2-0.5B's and Qwen2-1.5B's layers (both tie the head to the embeddings).
SHAPES = {
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "intermediate_size": 4864},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "intermediate_size": 8960},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="Directory to write (config.json, model.safetensors, tokenizer).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="Qwen2's size to copy.")
    args = p.parse_args()
    config = Qwen2Config(
        **SHAPES[args.shape],
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.path, safe_serialization=True)
    write_tokenizer(args.path)
    pad_vocabulary(Path(args.path), config.vocab_size)
    print(args.path)


if __name__ == "__main__":
    main()
