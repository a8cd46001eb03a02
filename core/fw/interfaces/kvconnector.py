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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fw.interfaces.base import Capabilities, Requirements
from fw.sdk.block_hash import block_hash_chain  # pure Python: listing plugins still imports no torch

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
    """Runs in the scheduler process. The engine calls, per step::

        get_num_new_matched_tokens()  each request it admits (not those asking for prompt logprobs)
        update_state_after_alloc()    after allocating the request's blocks
        request_computed()            each scheduled request
        build_connector_meta()        once; the result travels to every worker in the step's inputs
        request_finished()            when a request ends or is aborted, before its blocks are freed
    """

    # True: the worker loads after the step that scheduled the load, and reports it in
    # ``KVConnectorWorker.get_finished().loaded``; the request waits for it without being scheduled.
    # False: ``start_load_kv`` completes the loads before the forward pass of the same step.
    load_async: ClassVar[bool] = False

    def __init__(self, options: BaseModel | None, block_size: int) -> None:
        self.options = options
        self.block_size = block_size

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, cache_keys: tuple = ()
    ) -> int:
        """Tokens past ``num_computed_tokens`` (already local) that can be loaded from outside.

        ``token_ids``: the request's tokens (its prompt; after a preemption, its outputs too). At most
        ``len(token_ids) - 1 - num_computed_tokens``: the last token is computed locally, its logits
        give the next token. ``cache_keys`` (the prompt's ``cache_salt``) keep prompts apart as they keep the
        prefix cache's blocks apart: KV saved under other keys must never match.
        """

    @abstractmethod
    def update_state_after_alloc(self, request_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request (``block_ids``: its whole block table, in logical
        order); remember which to fill with the ``num_external_tokens`` loaded tokens."""

    def request_computed(
        self, request_id: str, token_ids: Sequence[int], block_ids: list[int], num_computed_tokens: int,
        cache_keys: tuple = (),
    ) -> None:
        """Once this step runs, the request's first ``num_computed_tokens`` of ``token_ids`` have KV in
        ``block_ids`` (its whole block table): where a connector learns what it may save."""

    @abstractmethod
    def build_connector_meta(self) -> Any:
        """Called once per step: what the worker side must load and save in this step (plain, picklable data)."""

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        """The request ended. Return True to keep its blocks until the worker reports them in ``get_finished().sent``.

        Also called, its answer ignored, when the request's load failed: forget it, it computes from scratch.
        """
        return False


@dataclass
class KVTransferReport:
    """What a worker's transfers did since the previous report."""

    sent: set[str] = field(default_factory=set)  # requests whose held blocks (request_finished -> True) may be freed
    loaded: set[str] = field(default_factory=set)  # asynchronous loads that completed
    failed: set[str] = field(default_factory=set)  # loads that failed or timed out: the engine recomputes
    bytes_loaded: int = 0
    bytes_saved: int = 0
    seconds: float = 0.0  # time spent transferring (loads and saves)


class KVConnectorWorker(ABC):
    """Runs next to the KV cache, in every worker process. Per step: ``start_load_kv(meta)``; per attention
    layer ``wait_for_layer_load(i)`` before it and ``save_kv_layer(i, ...)`` after it; ``wait_for_save()``;
    then ``get_finished()``. A step that computes nothing, run only because transfers are in flight,
    skips the layers."""

    def __init__(self, options: BaseModel | None) -> None:
        self.options = options

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    @abstractmethod
    def start_load_kv(self, meta: Any) -> None:
        """Before the forward pass: begin loading the step's external KV into the caches.

        A load that cannot complete must not raise: report its request in ``get_finished().failed``.
        """

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s KV is in place (layer-wise pipelining)."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, meta: Any) -> None:
        """After a layer ran: begin saving the blocks that the step's metadata asks for."""

    def wait_for_save(self) -> None:
        """Block until every save of the step is complete."""

    def get_finished(self) -> KVTransferReport:
        """After the step: what completed or failed since the last call."""
        return KVTransferReport()

    def shutdown(self) -> None:
        """The engine stops: release sockets, threads and buffers."""


class SavedBlocks:
    """A worker's helper for saves: ``save_kv_layer`` gathers the step's blocks layer by layer, ``wait_for_save``
    takes them to the host all at once.

    The copies stay on the cache's device until then: no host sync in the middle of the forward pass, and later
    writes to the cache cannot change them.
    """

    def __init__(self) -> None:
        self._layers: dict[int, torch.Tensor] = {}  # layer -> [parts, n_saves, block_size, ...]
        self._saves: Any = ()

    def gather(self, layer_idx: int, kv_cache: torch.Tensor, block_ids: list[int], saves: Any) -> None:
        """Copy ``block_ids`` of layer ``layer_idx``; ``saves`` (what they are, one entry per block) comes back from take()."""
        import torch

        self._layers[layer_idx] = kv_cache.index_select(1, torch.tensor(block_ids, device=kv_cache.device))
        self._saves = saves

    def take(self, num_layers: int) -> tuple[list[torch.Tensor], Any]:
        """Every layer's copies on the host, in layer order, and the saves; ``([], ())`` when the step saved nothing."""
        layers, saves = self._layers, self._saves
        self._layers, self._saves = {}, ()
        if not layers:
            return [], ()
        if sorted(layers) != list(range(num_layers)):
            raise RuntimeError(f"save_kv_layer ran for layers {sorted(layers)} of {num_layers}: a block needs every layer")
        return [layers[i].cpu() for i in range(num_layers)], saves


@dataclass(frozen=True)
class PrefixBlockMeta:
    """One step's transfers of a ``PrefixBlockScheduler``, as plain data (it travels to the workers)."""

    # (request_id, ((block_id, block_hash), ...)): fill the request's blocks with the KV stored under the hashes
    loads: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    # (request_id, block_id, block_hash): store the block's KV under the hash
    saves: tuple[tuple[str, int, int], ...] = ()


class PrefixBlockScheduler(KVConnectorScheduler):
    """The scheduler half of a connector that stores prompt blocks under their prefix hash
    (``fw.sdk.block_hash.block_hash_chain``, cache keys included), so a stored block stands for exactly one prefix.

    A subclass says how many leading blocks of a chain its store can provide (``stored_prefix``) and which
    computed blocks are worth saving (``should_save``); the bookkeeping of matches, loads and saves is here.
    With ``partial_blocks`` the chain also covers the prompt's last, incomplete block (up to the last token,
    which is always computed locally): a consumer then computes nothing else. The options' ``role``, where
    there is one, turns loads (``producer``) or saves (``consumer``) off.
    """

    partial_blocks: ClassVar[bool] = False

    def __init__(self, options: BaseModel | None, block_size: int) -> None:
        super().__init__(options, block_size)
        self._chains: dict[str, tuple[list[int], int]] = {}  # request -> (its prompt's hashes, tokens they cover)
        self._matched: dict[str, tuple[int, list[int]]] = {}  # request -> (first block index, hashes found)
        self._next_save: dict[str, int] = {}  # request -> first block not yet considered for saving
        self._loads: list[tuple[str, tuple[tuple[int, int], ...]]] = []
        self._saves: dict[int, tuple[str, int]] = {}  # hash -> (request, block id): a prefix saved once per step

    @property
    def loads_kv(self) -> bool:
        return getattr(self.options, "role", "both") != "producer"

    @property
    def saves_kv(self) -> bool:
        return getattr(self.options, "role", "both") != "consumer"

    @abstractmethod
    def stored_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` the store can provide now."""

    def should_save(self, block_hash: int) -> bool:
        """Whether a computed block is saved (False where the store holds it already)."""
        return True

    def _chain(self, request_id: str, token_ids: Sequence[int], cache_keys: tuple) -> tuple[list[int], int]:
        # Taken when the request is first seen: after a preemption token_ids holds outputs too, which are not saved.
        if request_id not in self._chains:
            end = len(token_ids) - 1 if self.partial_blocks else len(token_ids) // self.block_size * self.block_size
            self._chains[request_id] = (block_hash_chain(token_ids[:end], self.block_size, cache_keys), end)
        return self._chains[request_id]

    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, cache_keys: tuple = ()
    ) -> int:
        self._matched.pop(request_id, None)
        if not self.loads_kv or num_computed_tokens % self.block_size:  # stored blocks cannot complete a block
            return 0
        hashes, _ = self._chain(request_id, token_ids, cache_keys)
        first, loadable = num_computed_tokens // self.block_size, len(token_ids) - 1
        last = -(-loadable // self.block_size) if self.partial_blocks else loadable // self.block_size
        wanted = hashes[first:last]
        count = self.stored_prefix(wanted) if wanted else 0
        if not count:
            return 0
        self._matched[request_id] = (first, wanted[:count])
        return min((first + count) * self.block_size, loadable) - num_computed_tokens

    def update_state_after_alloc(self, request_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        first, found = self._matched.pop(request_id, (0, []))
        count = -(-num_external_tokens // self.block_size)  # a partial last block counts
        if count:
            self._loads.append((request_id, tuple(zip(block_ids[first : first + count], found[:count], strict=True))))

    def request_computed(
        self, request_id: str, token_ids: Sequence[int], block_ids: list[int], num_computed_tokens: int,
        cache_keys: tuple = (),
    ) -> None:
        if not self.saves_kv:
            return
        hashes, end = self._chain(request_id, token_ids, cache_keys)
        i = self._next_save.get(request_id, 0)
        while i < len(hashes) and num_computed_tokens >= min((i + 1) * self.block_size, end):
            if hashes[i] not in self._saves and self.should_save(hashes[i]):
                self._saves[hashes[i]] = (request_id, block_ids[i])
            i += 1
        self._next_save[request_id] = i

    def build_connector_meta(self) -> PrefixBlockMeta:
        meta = PrefixBlockMeta(tuple(self._loads), tuple((r, b, h) for h, (r, b) in self._saves.items()))
        self._loads, self._saves = [], {}
        return meta

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        """Forgets the request and drops its pending transfers: one that ends before its step's metadata is built
        (an abort) frees blocks that may be handed out again. False: saves complete within their step."""
        for state in (self._chains, self._matched, self._next_save):
            state.pop(request_id, None)
        self._loads = [load for load in self._loads if load[0] != request_id]
        self._saves = {h: save for h, save in self._saves.items() if save[0] != request_id}
        return False


@dataclass(frozen=True)
class KVConnector:
    """What a kvconnector plugin's ``impl`` resolves to: its two halves."""

    scheduler: type[KVConnectorScheduler]
    worker: type[KVConnectorWorker]
