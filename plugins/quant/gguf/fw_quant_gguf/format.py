"""The GGUF checkpoint format: one file carrying the model's config, its weights and its tokenizer.

The config names the quant format "gguf" (with each linear weight's ggml type), so the weights go to this
distribution's quant method, which keeps their blocks packed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fw.interfaces.checkpoint_format import CheckpointFormat
from fw.sdk.tokenizer import Tokenizer
from fw_quant_gguf import checkpoint, tokenizer


class GGUFFormat(CheckpointFormat):
    def config(self, model_path: str) -> dict[str, Any]:
        return checkpoint.hf_config(checkpoint.open_reader(model_path), model_path)

    def weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        return checkpoint.iter_tensors(model_path)

    def tokenizer(self, model_path: str) -> Tokenizer:
        return tokenizer.load(checkpoint.open_reader(model_path))
