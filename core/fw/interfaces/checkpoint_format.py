"""Checkpoint-format interface (plugin kind ``checkpoint_format``).

A checkpoint format reads one kind of model file: its Hugging Face-style config, its (name, tensor) weights, and
the tokenizer when the file carries one. Formats are split from quantization (``fw.interfaces.quant``): a format
only names, in its config's ``quantization_config.quant_method``, the quant format its weights are stored in; the
quant slot (``--quant auto`` or a name) then picks the quant method whose ``QuantCapabilities.formats`` lists it.

- The core's own format is a model directory: config.json, safetensors files, tokenizer.json
  (``fw.model_loader.DirectoryFormat``). It reads every path no format plugin claims. GPTQ, AWQ,
  compressed-tensors and FP8 checkpoints are such directories, whose ``quantization_config`` picks the quant
  method (a ``fw_detect_quant_format`` hook tells apart the schemes that share one ``quant_method``, as
  compressed-tensors' do).
- A format plugin claims paths by their suffix (``CheckpointFormatCapabilities.suffixes``): data, so that checking
  a model never imports a format that does not read it. GGUF is one: a single file carrying config, weights and
  tokenizer, whose config names the quant format "gguf"; its distribution registers the format and the quant
  method that reads its blocks, each under its own entry-point group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fw.interfaces.base import Capabilities

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from fw.sdk.tokenizer import Tokenizer

API_VERSION = 1


@dataclass(frozen=True)
class CheckpointFormatCapabilities(Capabilities):
    # File-name endings of the checkpoints this format reads (".gguf"), compared case-insensitively.
    suffixes: frozenset[str] = frozenset()

    def claims(self, model_path: str) -> bool:
        return str(model_path).lower().endswith(tuple(s.lower() for s in self.suffixes))


class CheckpointFormat(ABC):
    """Reads the checkpoints at the paths its capabilities claim; stateless, so one instance reads any of them."""

    api_version = API_VERSION

    def __init__(self, options: BaseModel | None = None) -> None:
        # Built like every plugin (fw.plugins.build): with its spec's parsed options (None: it declares none).
        self.options = options

    @abstractmethod
    def config(self, model_path: str) -> dict[str, Any]:
        """The Hugging Face-style config: ``architectures``, the sizes, and, for quantized weights, a
        ``quantization_config`` whose ``quant_method`` names their quant format (and whatever its quant method reads
        there). Raises ``fw.sdk.errors.ModelError`` naming what is wrong with the file."""

    @abstractmethod
    def weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face parameter name, tensor), streamed: the model's layers load each as it comes, in the quant
        method's stored form."""

    def tokenizer(self, model_path: str) -> Tokenizer | None:
        """The tokenizer the checkpoint carries. None, the default: the core reads tokenizer.json from
        ``--tokenizer`` or the model directory."""
        return None
