"""Quantization interface (plugin kind ``fw.quant``).

A quant plugin's implementation is a ``QuantMethod``: it hands every linear
layer a ``LinearMethod`` that creates the layer's parameters (in whatever
packed form the checkpoint stores them) and computes ``x @ W.T + b``.
Formats whose files are not safetensors + config.json (GGUF) also provide
``checkpoint_config``, ``load_checkpoint`` and ``load_tokenizer``. The unquantized path is itself a plugin (``none``).

Checkpoint-format detection is data: ``config.json``'s
``quantization_config.quant_method`` (or a ``fw_detect_quant_format`` hook)
names a format, and "auto" chooses the highest-priority plugin whose
``QuantCapabilities.formats`` lists it ("none", priority 10, for plain weights;
a plugin that also loads plain checkpoints runs when named, or above it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fw.interfaces.attention import FEATURES
from fw.interfaces.base import Capabilities, Requirements

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from fw.tokenizer import Tokenizer

API_VERSION = 1


@dataclass(frozen=True)
class QuantCapabilities(Capabilities):
    # Checkpoint formats this plugin loads ("fp8", "awq", "gptq", "gguf"); "none" for plain weights.
    formats: frozenset[str] = frozenset({"none"})
    # Attention features this scheme needs (e.g. "fp8_kv"); checked against the chosen backend.
    requires_attention_features: frozenset[str] = frozenset()

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {**Capabilities.KNOWN, "requires_attention_features": FEATURES}

    def problems(self, req: Requirements) -> list[str]:
        out = super().problems(req)
        fmt = req.quant_format or "none"
        if fmt not in self.formats:
            out.append(f"cannot load {fmt!r} checkpoints (loads: {', '.join(sorted(self.formats))})")
        return out


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight."""

    @abstractmethod
    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the parameters on ``layer``, sized for this tensor-parallel rank.

        ``output_sizes`` lists the fused sub-matrices (q, k, v or gate, up) in
        order. Each parameter carries ``output_dim`` / ``input_dim`` attributes
        (the dimension that is split across ranks, or None) so that the layer's
        weight loader can shard and place checkpoint tensors.
        """

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Compute ``x @ W.T (+ bias)`` for ``x`` of shape [..., input_size]."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights for the kernel (transpose, pre-dequantize, ...)."""


class QuantMethod(ABC):
    api_version = API_VERSION

    def __init__(self, options: BaseModel | None = None, quant_config: dict[str, Any] | None = None) -> None:
        self.options = options
        # config.json's quantization_config (or the equivalent the plugin's loader read).
        self.quant_config = quant_config or {}

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``)."""

    def checkpoint_config(self, model_path: str) -> dict[str, Any] | None:
        """For single-file formats the core cannot read (GGUF): the Hugging Face–style config dict.

        None means the model is a directory with config.json, which the core reads.
        """
        return None

    def load_checkpoint(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]] | None:
        """For such formats: (Hugging Face parameter name, tensor) pairs. None: the core reads safetensors."""
        return None

    def load_tokenizer(self, model_path: str) -> Tokenizer | None:
        """For such formats: the tokenizer the file carries. None: the core reads tokenizer.json."""
        return None
