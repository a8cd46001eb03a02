"""LMCache KV connector: prompt-prefix KV blocks kept in LMCache's storage backends.

Every prompt block the engine computes, the last partial one included, is saved under its prefix hash
(``fw.sdk.block_hash.block_hash_chain`` over the prompt, its ``cache_salt`` included) through LMCache's
``StorageManager``, into one backend:

- ``cpu``: LMCache's RAM backend (``LocalCPUBackend``), least recently used blocks evicted;
- ``disk``: its local-disk backend (``LocalDiskBackend``), one file per block, indexed in memory;
- ``lm://HOST:PORT``: its remote backend talking to an LMCache server (``python -m lmcache.v1.server``).

Only the server is shared between processes: LMCache keeps the RAM blocks and the disk index in the process that
saved them. A prompt whose blocks are in the store loads them instead of computing them; since the partial block
is saved too, a consumer computes only the prompt's last token, which makes a producer instance and a consumer
instance sharing a server a disaggregated prefill/decode pair.

Both halves share one ``LMCacheStore`` per set of options in the process: the scheduler half looks blocks up, the
worker half moves their data (the interface gives the scheduler half no channel to the worker, and the worker
runs in the engine process). A block is stored as its bytes for every layer, under a key that names the cache's
layout and the ``namespace`` option: blocks of another layout never match (models of one layout sharing a store
need a namespace each).

Loads are synchronous: they complete in ``start_load_kv``. A block the store no longer holds, or that the server
cannot deliver in ``timeout`` seconds, fails its request's load: the engine computes the tokens, and nothing that
request computed in the step is saved. Saves complete in ``wait_for_save``: when a step ends, its blocks are in
the store (for a server: it answered a lookup sent after them), so a router may hand the request to a consumer.

LMCache 0.5.6's client limits what this can promise: a server that is down is a miss, but one that accepts
connections and never answers stalls lookups (they have no timeout), and a connection lost is not re-established
(that is the health monitor's work, part of LMCache's engine, which is not used here).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import ClassVar, TypeVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from fw.interfaces.kvconnector import (
    KVConnector,
    KVConnectorWorker,
    KVTransferReport,
    PrefixBlockMeta,
    PrefixBlockScheduler,
    SavedBlocks,
)
from fw_kvconnector_lmcache.spec import LMCacheOptions

log = logging.getLogger("fw")

T = TypeVar("T")

_BACKENDS = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend"}  # LMCache's names; lm:// is its RemoteBackend


def lmcache_config(options: LMCacheOptions) -> LMCacheEngineConfig:
    # LocalCPUBackend always exists: it allocates the buffers blocks pass through. local_cpu makes it a store too,
    # which only the cpu backend wants (elsewhere lookups must reach the disk or the server).
    settings = {
        "local_cpu": options.backend == "cpu",
        "max_local_cpu_size": options.cpu_bytes / (1 << 30),  # LMCache counts GiB
        "blocking_timeout_secs": options.timeout,
    }
    if options.backend == "disk":
        settings |= {"local_disk": options.path, "max_local_disk_size": options.disk_bytes / (1 << 30)}
    elif options.backend != "cpu":
        settings |= {"remote_url": options.backend, "remote_serde": "naive"}
    return LMCacheEngineConfig.from_defaults(**settings)


def _in_daemon_thread(make: Callable[[], T]) -> T:
    """``make()``, called from a daemon thread. LMCache's storage threads are not daemons, and an engine is not
    always shut down (an ``LLM`` dropped, a test ending): created from a daemon thread they inherit the flag and
    cannot keep the interpreter from exiting."""
    result: dict[str, T | BaseException] = {}

    def run() -> None:
        try:
            result["value"] = make()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="fw-kv-lmcache-init", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _layer_views(data: torch.Tensor, layers: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """A stored block's bytes (``data``) seen as its ``layers``' KV, one after the other."""
    offset = 0
    for layer in layers:
        yield data[offset : offset + layer.nbytes].view(layer.dtype).view(layer.shape)
        offset += layer.nbytes


def _close(manager: StorageManager) -> None:
    manager.clear(["LocalCPUBackend"])  # its blocks go back to the buffer before LMCache frees the buffer
    manager.close()


class LMCacheStore:
    """One LMCache ``StorageManager`` and the cache layout its keys name."""

    _open: ClassVar[weakref.WeakValueDictionary[str, LMCacheStore]] = weakref.WeakValueDictionary()

    @classmethod
    def open(cls, options: LMCacheOptions) -> LMCacheStore:
        """The store of these options (the role aside) in this process, shared by the halves of every connector."""
        name = options.model_dump_json(exclude={"role"})
        store = cls._open.get(name)
        if store is None:
            store = cls._open[name] = cls(options)
        return store

    def __init__(self, options: LMCacheOptions) -> None:
        self.options = options
        # LMCache's metadata describes the vLLM layout it would gather from; blocks here are opaque bytes.
        metadata = LMCacheMetadata(
            model_name="fw",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=(1, 1, 1, 1, 1),
        )
        self.manager = _in_daemon_thread(lambda: StorageManager(lmcache_config(options), metadata, EventManager()))
        weakref.finalize(self, _close, self.manager)
        # Lookups and loads go to the storing backend itself: the manager's get would also copy every block
        # fetched from disk or a server into LocalCPUBackend, which serves here as a buffer only.
        self.backend = self.manager.storage_backends[_BACKENDS.get(options.backend, "RemoteBackend")]
        self.layout: tuple[int, int] | None = None  # (layout checksum, bytes per block), from the worker's caches

    def bind(self, layout: int, block_bytes: int) -> None:
        if self.layout not in (None, (layout, block_bytes)):
            raise RuntimeError(
                "KV connector lmcache: this store serves another model in this process; give each model its own "
                "namespace"
            )
        self.layout = (layout, block_bytes)
        # LMCache's objects are 4-d, (K/V, layers, tokens, bytes) where it reads them; a block is one opaque row.
        self.shape = torch.Size([1, 1, 1, block_bytes])

    def key(self, block_hash: int) -> CacheEngineKey:
        return CacheEngineKey(f"fw{self.options.namespace}-{self.layout[0]:08x}", 1, 0, block_hash, torch.uint8)

    def contains(self, block_hash: int) -> bool:
        return self.layout is not None and self.backend.contains(self.key(block_hash))

    def put(self, blocks: dict[int, list[torch.Tensor]]) -> int:
        """Store each block (hash -> its layers' KV, on the host), wait until the store holds them; how many were sent."""
        keys, objs = [], []
        for block_hash, layers in blocks.items():
            # No busy wait for a full buffer: the puts in flight that would free it are waited for below.
            obj = self.manager.allocate(self.shape, torch.uint8, MemoryFormat.KV_2LTD, busy_loop=False)
            if obj is None:
                log.warning(
                    "KV connector lmcache: no room in the %d-byte buffer; a block is not saved", self.options.cpu_bytes
                )
                continue
            for view, layer in zip(_layer_views(obj.tensor.view(-1), layers), layers, strict=True):
                view.copy_(layer)
            keys.append(self.key(block_hash))
            objs.append(obj)
        if not keys:
            return 0
        self.manager.batched_put(keys, objs)
        deadline = time.monotonic() + self.options.timeout
        while any(self.backend.exists_in_put_tasks(key) for key in keys):
            if time.monotonic() > deadline:
                log.warning("KV connector lmcache: saves still in flight after %d s", self.options.timeout)
                return len(keys)
            time.sleep(0.001)
        # A server answers in order: its answer to this lookup means it stored every block sent before it.
        self.backend.contains(keys[-1])
        return len(keys)

    def get(self, block_hash: int, copy_in: Callable[[torch.Tensor], None]) -> None:
        """Hand the block's bytes to ``copy_in`` (they are LMCache's buffer: valid during the call only);
        LookupError or ValueError where the store cannot deliver the block."""
        obj = self.backend.get_blocking(self.key(block_hash))
        if obj is None:
            raise LookupError(f"block {block_hash:016x} is not in the store (evicted, or the server is gone)")
        try:
            data = obj.tensor.view(-1)
            if data.numel() != self.layout[1]:
                raise ValueError(
                    f"block {block_hash:016x} has {data.numel()} bytes, this cache's blocks {self.layout[1]}"
                )
            copy_in(data)
        finally:
            obj.ref_count_down()


class LMCacheScheduler(PrefixBlockScheduler):
    # The prompt's last, partial block is saved too: a consumer computes only the prompt's last token.
    partial_blocks = True

    def __init__(self, options: LMCacheOptions | None, block_size: int) -> None:
        super().__init__(options or LMCacheOptions(), block_size)
        self.store = LMCacheStore.open(self.options)

    def stored_prefix(self, hashes: list[int]) -> int:
        count = 0
        while count < len(hashes) and self.store.contains(hashes[count]):
            count += 1
        return count

    def should_save(self, block_hash: int) -> bool:
        return not self.store.contains(block_hash)  # loaded, or saved by another request or instance


class LMCacheWorker(KVConnectorWorker):
    def __init__(self, options: LMCacheOptions | None) -> None:
        super().__init__(options or LMCacheOptions())
        self.store = LMCacheStore.open(self.options)
        self.kv_caches: list[torch.Tensor] = []
        self._saved = SavedBlocks()
        self._report = KVTransferReport()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        layout = repr([(tuple(c[:, 0].shape), str(c.dtype)) for c in kv_caches])
        self.block_bytes = sum(c[:, 0].nbytes for c in kv_caches)
        self.store.bind(zlib.crc32(layout.encode()), self.block_bytes)

    def start_load_kv(self, meta: PrefixBlockMeta) -> None:
        start = time.perf_counter()
        for request_id, blocks in meta.loads:
            try:
                for block_id, block_hash in blocks:
                    self.store.get(block_hash, functools.partial(self._copy_in, block_id))
                    self._report.bytes_loaded += self.block_bytes
            except Exception as exc:  # noqa: BLE001 - whatever the store failed with, the engine recomputes
                log.warning("KV connector lmcache: request %s computes its prompt: %s", request_id, exc)
                self._report.failed.add(request_id)
        self._report.seconds += time.perf_counter() - start

    def _copy_in(self, block_id: int, data: torch.Tensor) -> None:
        layers = [cache[:, block_id] for cache in self.kv_caches]
        for view, layer in zip(_layer_views(data, layers), layers, strict=True):
            layer.copy_(view)

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, meta: PrefixBlockMeta) -> None:
        if meta.saves:  # into the store in wait_for_save
            self._saved.gather(layer_idx, kv_cache, [block_id for _, block_id, _ in meta.saves], meta.saves)

    def wait_for_save(self) -> None:
        start = time.perf_counter()
        on_host, saves = self._saved.take(len(self.kv_caches))
        # What a failed request computed on top of KV that never arrived is not saved.
        blocks = {h: [t[:, j] for t in on_host] for j, (r, _, h) in enumerate(saves) if r not in self._report.failed}
        if blocks:
            self._report.bytes_saved += self.store.put(blocks) * self.block_bytes
        self._report.seconds += time.perf_counter() - start

    def get_finished(self) -> KVTransferReport:
        report, self._report = self._report, KVTransferReport()
        return report


KV_CONNECTOR = KVConnector(scheduler=LMCacheScheduler, worker=LMCacheWorker)
