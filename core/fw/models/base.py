"""What every model class is constructed from: the checkpoint's config and the run's choices.

``HFConfig`` reads ``config.json`` without transformers: the core must run
(and list plugins) where transformers is not installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from types import MappingProxyType
from typing import Any

import torch

from fw.interfaces.attention import AttentionBackend
from fw.interfaces.quant import QuantMethod


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


class HFConfig:
    """Read-only attribute view of a Hugging Face ``config.json``.

    ``config.hidden_size`` raises AttributeError when absent; ``config.get(name,
    default)`` supplies the default transformers would use. Nested dicts come
    back as read-only mappings and lists as tuples.
    """

    def __init__(self, data: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_data", dict(data))

    @classmethod
    def from_file(cls, path: str | PathLike[str]) -> HFConfig:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    def __getattr__(self, name: str) -> Any:
        try:
            return _frozen(self._data[name])
        except KeyError:
            raise AttributeError(f"config has no {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only")

    def __contains__(self, name: str) -> bool:
        return name in self._data

    def get(self, name: str, default: Any = None) -> Any:
        """The value, or ``default`` when the key is missing or null."""
        value = self._data.get(name)
        return default if value is None else _frozen(value)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._data))

    def __repr__(self) -> str:
        return f"HFConfig({self._data!r})"

    # Derived values that several architectures share.

    @property
    def architecture(self) -> str | None:
        archs = self.get("architectures")
        return archs[0] if archs else None

    @property
    def head_dim(self) -> int:
        return self.get("head_dim") or self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.get("num_key_value_heads", self.num_attention_heads)

    @property
    def num_experts(self) -> int:
        # transformers 5 saves some MoE configs' num_experts under its alias num_local_experts.
        return self.get("num_experts") or self.get("num_local_experts", 0)

    def rope_parameters(self) -> dict[str, Any]:
        """RoPE settings in transformers 5's ``rope_parameters`` form, also from older configs.

        Older configs keep ``rope_theta`` at the top level and the scaling in
        ``rope_scaling`` (type under ``type`` or ``rope_type``).
        """
        params = dict(self.get("rope_scaling") or self.get("rope_parameters") or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        if params["rope_type"] in ("llama3", "yarn", "longrope"):
            if "original_max_position_embeddings" in self:  # Phi-3 keeps it at the top level, and it wins
                params["original_max_position_embeddings"] = self.original_max_position_embeddings
            else:
                params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return params


@dataclass
class ModelContext:
    """The run's choices a model needs at construction."""

    dtype: torch.dtype
    quant: QuantMethod
    attention: AttentionBackend
