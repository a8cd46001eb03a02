"""Model architecture interface (plugin kind ``fw.models``).

A model plugin maps Hugging Face ``config.json`` ``architectures`` names to a
``torch.nn.Module`` that also derives from ``ModelBase`` (below: what the engine
calls), with this shape (the built-ins in ``fw.models`` are the examples):

- ``__init__(self, config: fw.models.base.HFConfig, ctx: fw.models.base.ModelContext)``
- ``forward(input_ids [T], positions [T]) -> hidden states [T, hidden]``
  (attention layers read the step's KV cache and metadata from
  ``fw.forward_context``)
- ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32, whatever the model's dtype (full
  vocabulary on every rank; ``fw.layers.embedding.ParallelLMHead`` does this)
- ``greedy_tokens(hidden [N, hidden]) -> [N]`` int64 or None (optional): greedy decoding's tokens without
  every logit, where the LM head can (``ParallelLMHead.greedy``)
- ``load_weights(weights: Iterable[tuple[str, Tensor]]) -> set[str]``
  (checkpoint names as in the Hugging Face checkpoint; returns the parameter names loaded)

A model that declares the feature ``pipeline_parallel`` builds only the layers of its stage
(``fw.distributed.stage_layers``), passes hidden states between stages through ``get_pp_group()``, and lists
only its stage's layers in ``attention_specs()`` (``layer_idx`` keeps the layer's number); the last stage's
``compute_logits`` gives the logits. ``-pp`` is refused for a model without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fw.interfaces.attention import FEATURES, AttentionLayerSpec
from fw.interfaces.base import Capabilities, Requirements

if TYPE_CHECKING:
    import torch

API_VERSION = 1


@dataclass(frozen=True)
class ModelCapabilities(Capabilities):
    architectures: frozenset[str] = frozenset()
    # Attention features every model of these architectures needs ("mla"); validation asks them of the backend.
    requires_attention_features: frozenset[str] = frozenset()

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {
        **Capabilities.KNOWN, "requires_attention_features": FEATURES, "features": frozenset({"pipeline_parallel"})
    }

    def problems(self, req: Requirements) -> list[str]:
        out = super().problems(req)
        if req.architecture and req.architecture not in self.architectures:
            out.append(f"does not implement {req.architecture}")
        return out


class ModelBase(ABC):
    """What the engine calls on a model: derive the ``torch.nn.Module`` a ``fw.models`` spec names from it too
    (``class MyForCausalLM(nn.Module, ModelBase)``; not an ``nn.Module`` itself, so that reading this file for
    listing plugins imports no torch). The module docstring says what each call receives."""

    # True when a decode step runs the same ops on tensors every time, so fw.decode_graph may trace it once and
    # replay it; False for a model whose step reads tensor values into Python (DeepSeek's routing).
    decode_graphs: ClassVar[bool] = False
    # True when ``forward`` returns the final hidden states that ``compute_logits`` reads (after the final norm):
    # what embeddings pool (fw.pooling). False refuses pooling requests with a clear error.
    supports_pooling: ClassVar[bool] = True

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens (the last pipeline stage's; earlier stages send theirs on)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] over the full vocabulary on every rank."""

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``compute_logits(hidden)`` (int64 [N], the first of equal values), where the model
        can give it without every logit (``fw.layers.embedding.ParallelLMHead.greedy``); None, the default: the
        engine computes the logits."""
        return None

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named checkpoint tensors; the names of the parameters loaded."""

    @abstractmethod
    def attention_specs(self) -> list[AttentionLayerSpec]:
        """One spec per attention layer this stage holds, in order (``layer_idx`` keeps the layer's number):
        what the KV cache is sized and laid out from."""
