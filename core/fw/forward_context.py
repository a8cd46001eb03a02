"""Per-step state that attention layers read without threading it through every module.

The model runner wraps each forward in ``set_forward_context(metadata,
kv_caches)``; an ``Attention`` layer picks its own cache by layer index. This
keeps model ``forward`` signatures to ``(input_ids, positions)``. With a KV
connector, each attention layer also waits for its loaded KV before running
and hands its cache to the connector's save after (``wait_for_kv_layer``,
``save_kv_layer``), so transfers overlap the other layers' compute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from fw.interfaces.comm import Pending
    from fw.interfaces.kvconnector import KVConnectorWorker


@dataclass
class ForwardContext:
    metadata: Any  # what the attention backend's prepare() returned for this step
    kv_caches: list[torch.Tensor]  # one tensor per attention layer, indexed by layer_idx
    kv_connector: KVConnectorWorker | None = None
    connector_meta: Any = None  # the step's KVConnectorScheduler.build_connector_meta()
    # Sends to the next pipeline stage still in flight (Communicator.isend handles): the runner completes them
    # at the end of the step, so that a stage computes its next micro-batch meanwhile.
    sends: list[Pending] = field(default_factory=list)


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    metadata: Any, kv_caches: list[torch.Tensor], kv_connector: KVConnectorWorker | None = None,
    connector_meta: Any = None,
) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(metadata, kv_caches, kv_connector, connector_meta)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: run the model inside fw.forward_context.set_forward_context(...)")
    return _current


def wait_for_kv_layer(layer_idx: int) -> None:
    """Before attention layer ``layer_idx`` reads its cache: the connector's loads into it are complete."""
    ctx = get_forward_context()
    if ctx.kv_connector is not None:
        ctx.kv_connector.wait_for_layer_load(layer_idx)


def save_kv_layer(layer_idx: int) -> None:
    """After attention layer ``layer_idx`` wrote the step's KV: the connector may start saving it."""
    ctx = get_forward_context()
    if ctx.kv_connector is not None:
        ctx.kv_connector.save_kv_layer(layer_idx, ctx.kv_caches[layer_idx], ctx.connector_meta)
