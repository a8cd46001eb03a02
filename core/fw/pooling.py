"""Pooling: a prompt's final hidden states (the final norm's output, before the LM head) as one embedding vector.

A pooling request runs through the same scheduler as generation, as a prefill that samples nothing: each step
the runner returns the hidden states of the positions its pooling type needs (``Pooling.positions``), the engine
folds them into the request's ``Pooling`` (``add``), and when the prompt's last position is computed the
request ends with the pooled vector (``finish``), cut to ``dimensions`` and L2-normalized as asked.

The pooling type (vLLM's): ``last`` (the last token's state, vLLM's default for a decoder LM), ``mean`` (over
every prompt position) or ``cls`` (the first position's). It comes from ``--pooling``, else the model's
sentence-transformers files (``modules.json`` naming a Pooling module whose ``config.json`` sets the mode, and a
Normalize module or not), else ``last`` with normalization, as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fw.request import Request
    from fw.step_inputs import StepInputs

# sentence-transformers' Pooling config keys for the modes vLLM pools by (its max and weighted-mean modes aside).
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's parameters, with vLLM's names. ``dimensions``: keep the first this many (Matryoshka
    models only); ``normalize``: L2-normalize (None: the model's pooling config, by default yes)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len


@dataclass(frozen=True)
class PoolerConfig:
    """How this model pools: type and normalization (module docstring)."""

    pooling_type: str = "last"
    normalize: bool = True

    @classmethod
    def resolve(cls, configured: str, model_path: str) -> PoolerConfig:
        """``configured`` (``--pooling``; auto: the model's sentence-transformers config) over the model's files."""
        found = _sentence_transformers_pooling(Path(model_path))
        base = cls(*found) if found else cls()
        return base if configured == "auto" else cls(configured, base.normalize)


def _sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from sentence-transformers' modules.json and its Pooling module's config."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is None:
        return None
    settings = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
    mode = next((kind for key, kind in _ST_MODES.items() if settings.get(key)), None)
    if mode is None:
        return None  # a mode vLLM has no pooler for either (max, weighted mean): keep the default
    return mode, any(m.get("type", "").endswith(".Normalize") for m in modules)


def dimensions_problem(dimensions: int | None, hf_config: Mapping[str, Any], hidden_size: int) -> str | None:
    """Why a request's ``dimensions`` cannot be served, as vLLM decides: only a Matryoshka model (config.json's
    ``is_matryoshka`` or ``matryoshka_dimensions``) keeps its meaning in a prefix of the vector."""
    if dimensions is None:
        return None
    allowed = hf_config.get("matryoshka_dimensions")
    if not (hf_config.get("is_matryoshka") or allowed):
        return "dimensions: the model does not support Matryoshka representation; changing the output dimensions " \
               "would give poor embeddings"
    if allowed and dimensions not in allowed:
        return f"dimensions: the model supports only {sorted(allowed)}"
    if not 1 <= dimensions <= hidden_size:
        return f"dimensions: must be in [1, {hidden_size}], got {dimensions}"
    return None


@dataclass(eq=False)
class Pooling:
    """One request's pooling, resolved from the model's config and its params, and its running state."""

    pooling_type: str
    normalize: bool
    dimensions: int | None = None
    partial: torch.Tensor | None = None  # mean: the sum of the rows so far; cls/last: the row itself
    result: torch.Tensor | None = None  # the embedding, once the prompt is computed

    @classmethod
    def of(cls, config: PoolerConfig, params: PoolingParams) -> Pooling:
        normalize = config.normalize if params.normalize is None else params.normalize
        return cls(config.pooling_type, normalize, params.dimensions)

    @property
    def needs_every_position(self) -> bool:
        """A prefix-cache hit skips positions: only last pooling can take one (as in vLLM)."""
        return self.pooling_type != "last"

    def positions(self, start: int, num_new: int, prompt_len: int) -> range:
        """The offsets, within a chunk of ``num_new`` positions from ``start``, whose hidden states it needs."""
        if self.pooling_type == "mean":
            return range(num_new)
        if self.pooling_type == "cls":
            return range(1 if start == 0 else 0)
        return range(num_new - 1, num_new) if start + num_new == prompt_len else range(0)

    def add(self, rows: torch.Tensor, start: int) -> None:
        """Fold in a chunk's rows; a chunk from position 0 starts over (a preempted request recomputes)."""
        if not len(rows):
            return
        if start == 0 or self.pooling_type != "mean":
            self.partial = None
        total = rows.sum(0) if self.pooling_type == "mean" else rows[0]
        self.partial = total if self.partial is None else self.partial + total

    def finish(self, prompt_len: int) -> None:
        vector = self.partial / prompt_len if self.pooling_type == "mean" else self.partial
        vector = vector[: self.dimensions] if self.dimensions else vector
        self.result = torch.nn.functional.normalize(vector, dim=0) if self.normalize else vector
        self.partial = None


def pool_step(requests: list[Request], inputs: StepInputs, hidden: torch.Tensor) -> None:
    """Give each pooling request of a step its rows of the step's final hidden states (``inputs.hidden_positions``
    holds them in request order)."""
    rows = hidden[torch.tensor(inputs.hidden_positions, device=hidden.device)].float()
    offset = 0
    for request, start, n in zip(requests, inputs.num_computed, inputs.num_new, strict=True):
        if request.pooling is not None:
            count = len(request.pooling.positions(start, n, request.num_tokens))
            request.pooling.add(rows[offset : offset + count], start)
            offset += count
