"""Model architecture interface (plugin kind ``fw.models``).

A model plugin maps Hugging Face ``config.json`` ``architectures`` names to a
``torch.nn.Module`` with this shape (the built-ins in ``fw.models`` are the
examples):

- ``__init__(self, config: fw.models.base.HFConfig, ctx: fw.models.base.ModelContext)``
- ``forward(input_ids [T], positions [T]) -> hidden states [T, hidden]``
  (attention layers read the step's KV cache and metadata from
  ``fw.forward_context``)
- ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32, whatever the model's dtype (full
  vocabulary on every rank; ``fw.layers.embedding.ParallelLMHead`` does this)
- ``load_weights(weights: Iterable[tuple[str, Tensor]]) -> set[str]``
  (checkpoint names as in the Hugging Face checkpoint; returns the parameter names loaded)

A model that declares the feature ``pipeline_parallel`` builds only the layers of its stage
(``fw.distributed.stage_layers``), passes hidden states between stages through ``get_pp_group()``, and lists
only its stage's layers in ``attention_specs()`` (``layer_idx`` keeps the layer's number); the last stage's
``compute_logits`` gives the logits. ``-pp`` is refused for a model without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fw.interfaces.attention import FEATURES
from fw.interfaces.base import Capabilities, Requirements

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
