"""Per-step state that attention layers read without threading it through every module.

The model runner wraps each forward in ``set_forward_context(metadata,
kv_caches)``; an ``Attention`` layer picks its own cache by layer index. This
keeps model ``forward`` signatures to ``(input_ids, positions)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class ForwardContext:
    metadata: Any  # what the attention backend's prepare() returned for this step
    kv_caches: list[torch.Tensor]  # one tensor per attention layer, indexed by layer_idx


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(metadata: Any, kv_caches: list[torch.Tensor]) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(metadata, kv_caches)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: run the model inside fw.forward_context.set_forward_context(...)")
    return _current
