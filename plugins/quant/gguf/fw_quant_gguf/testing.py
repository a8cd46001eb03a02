"""Random ggml blocks of every quantized type, for the tests: ``gguf.quants.quantize`` writes only some types
(no K-quants), and a decoder or product is checked as well on random bytes, as long as every fp16 scale in them
is a finite number."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

# Byte offsets of each block type's fp16 scales: random bytes there could be NaN or inf.
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip


def random_blocks(qtype: GGMLQuantizationType, rows: int, width: int, rng: np.random.Generator,
                  scale: float = 1.0) -> torch.Tensor:
    """uint8 ``[rows, row bytes]``: ``width`` weights a row (whole blocks) of random integers, with scales drawn
    from a normal distribution times ``scale``."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, width // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in F16_FIELDS[qtype]:
        blocks[:, at : at + 2] = (scale * rng.standard_normal((len(blocks), 1))).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw)
