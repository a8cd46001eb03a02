"""KV connector interface (plugin kind ``kv_connector``, entry-point group ``fw.kv_connector``).

A KV connector moves KV-cache blocks between this engine and the outside
(another instance for disaggregated prefill/decode, a disk or a remote
store). It has two halves that live in different places: the scheduler side
decides, per request, how many prompt tokens can be loaded instead of
computed, and describes each step's transfers; the worker side, next to the
KV-cache tensors, performs them layer by layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fw.interfaces.base import Capabilities, Requirements

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

API_VERSION = 1

ROLES = frozenset({"producer", "consumer", "both"})


@dataclass(frozen=True)
class KVConnectorCapabilities(Capabilities):
    roles: frozenset[str] = ROLES

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {**Capabilities.KNOWN, "roles": ROLES}

    def problems(self, req: Requirements) -> list[str]:
        out = super().problems(req)
        if req.kv_cache_dtype != "auto":
            out.append(f"does not transfer KV-cache dtype {req.kv_cache_dtype}")
        return out


class KVConnectorScheduler(ABC):
    """Runs in the scheduler process."""

    def __init__(self, options: BaseModel | None, block_size: int) -> None:
        self.options = options
        self.block_size = block_size

    @abstractmethod
    def get_num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Prompt tokens past ``num_computed_tokens`` (already local) that can be loaded from outside."""

    @abstractmethod
    def update_state_after_alloc(self, request_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request; remember which to fill with loaded KV."""

    @abstractmethod
    def build_connector_meta(self) -> Any:
        """Called once per step: what the worker side must load and save in this step."""

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        """The request ended. Return True to keep its blocks until the worker reports the save done."""
        return False


class KVConnectorWorker(ABC):
    """Runs next to the KV cache, in every worker process."""

    def __init__(self, options: BaseModel | None) -> None:
        self.options = options

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    @abstractmethod
    def start_load_kv(self, meta: Any) -> None:
        """Before the forward pass: begin loading the step's external KV into the caches."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s KV is in place (layer-wise pipelining)."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, meta: Any) -> None:
        """After a layer ran: begin saving the blocks that the step's metadata asks for."""

    def wait_for_save(self) -> None:
        """Block until every save of the step is complete."""


@dataclass(frozen=True)
class KVConnector:
    """What a kvconnector plugin's ``impl`` resolves to: its two halves."""

    scheduler: type[KVConnectorScheduler]
    worker: type[KVConnectorWorker]
