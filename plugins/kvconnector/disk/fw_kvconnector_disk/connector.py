"""Disk KV connector: prompt-prefix KV blocks shared through a directory.

A producer writes the KV of every full prompt block to
``<path>/<hash>.safetensors``, where ``hash`` is the block's prefix hash
(``fw.sdk.block_hash.block_hash_chain`` over the prompt, its ``cache_salt`` included), so a
file stands for exactly one prefix. A consumer (another instance, or this one
after a restart) given a prompt with that prefix loads the blocks instead of
computing them. A file holds the block's K and V for every layer and appears
atomically (written under a temporary name, then renamed): a file that exists
is complete, which is what the scheduler's existence check relies on.

Engine call order, per step::

    scheduler side                                   worker side
    get_num_new_matched_tokens()  new requests
    update_state_after_alloc()    after allocation
    request_computed()            scheduled requests
    build_connector_meta() -> meta  ---------------> start_load_kv(meta)
                                                     per layer i: wait_for_layer_load(i), attention,
                                                                  save_kv_layer(i, kv_caches[i], meta)
                                                     wait_for_save()   (writes the step's files)
                                                     get_finished()    (failed loads, bytes, time)
    request_finished()            when a request ends

Loads are synchronous: they complete in ``start_load_kv``, before the forward
pass. A file that cannot be read (deleted, corrupt, another model's) fails
its request's load, which the engine then recomputes; nothing that request
computed in the step is saved.

Files hold whole blocks as one worker sees them, so this connector serves a
single worker process per engine: with tensor or pipeline parallelism each
worker holds a shard and their files would collide.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from fw.interfaces.kvconnector import (
    KVConnector,
    KVConnectorWorker,
    KVTransferReport,
    PrefixBlockMeta,
    PrefixBlockScheduler,
    SavedBlocks,
)
from fw_kvconnector_disk.spec import DiskOptions

log = logging.getLogger("fw")


def block_file(root: str, block_hash: int) -> str:
    return os.path.join(root, f"{block_hash:016x}.safetensors")


class DiskScheduler(PrefixBlockScheduler):
    def __init__(self, options: DiskOptions | None, block_size: int) -> None:
        super().__init__(options or DiskOptions(), block_size)

    def _on_disk(self, block_hash: int) -> bool:
        return os.path.exists(block_file(self.options.path, block_hash))

    def stored_prefix(self, hashes: list[int]) -> int:
        count = 0
        while count < len(hashes) and self._on_disk(hashes[count]):
            count += 1
        return count

    def should_save(self, block_hash: int) -> bool:
        return not self._on_disk(block_hash)  # loaded blocks, or another producer's


class DiskWorker(KVConnectorWorker):
    def __init__(self, options: DiskOptions | None) -> None:
        super().__init__(options or DiskOptions())
        self.kv_caches: list[torch.Tensor] = []
        self._saved = SavedBlocks()
        self._report = KVTransferReport()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "the disk KV connector supports a single worker process per engine: with tensor or pipeline "
                "parallelism each worker holds a shard of every block and their files would collide"
            )
        super().register_kv_caches(kv_caches)

    def start_load_kv(self, meta: PrefixBlockMeta) -> None:
        # Loads finish here, before the forward pass, so wait_for_layer_load has nothing to wait for.
        start = time.perf_counter()
        for request_id, blocks in meta.loads:
            try:
                for block_id, block_hash in blocks:
                    self._report.bytes_loaded += self._load(block_id, block_file(self.options.path, block_hash))
            except Exception as exc:  # noqa: BLE001 - any unreadable file is a miss: the engine recomputes
                log.warning("KV connector disk: request %s computes its prompt: %s", request_id, exc)
                self._report.failed.add(request_id)
        self._report.seconds += time.perf_counter() - start

    def _load(self, block_id: int, name: str) -> int:
        tensors = load_file(name)
        if len(tensors) != len(self.kv_caches):
            raise RuntimeError(
                f"{name} holds {len(tensors)} layers but this model has {len(self.kv_caches)}; use one directory per model"
            )
        for layer_idx, cache in enumerate(self.kv_caches):
            block, dst = tensors[f"layer.{layer_idx}"], cache[:, block_id]
            if block.shape != dst.shape or block.dtype != dst.dtype:
                raise RuntimeError(
                    f"{name} layer {layer_idx} is {block.dtype} {tuple(block.shape)}, the cache block is "
                    f"{dst.dtype} {tuple(dst.shape)}; use one directory per model"
                )
        for layer_idx, cache in enumerate(self.kv_caches):
            cache[:, block_id].copy_(tensors[f"layer.{layer_idx}"])
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, meta: PrefixBlockMeta) -> None:
        if meta.saves:  # the files are written in wait_for_save
            self._saved.gather(layer_idx, kv_cache, [block_id for _, block_id, _ in meta.saves], meta.saves)

    def wait_for_save(self) -> None:
        start = time.perf_counter()
        on_host, saves = self._saved.take(len(self.kv_caches))
        if not saves:
            return
        os.makedirs(self.options.path, exist_ok=True)
        for j, (request_id, _, block_hash) in enumerate(saves):
            if request_id in self._report.failed:  # computed on top of KV that never arrived
                continue
            tensors = {f"layer.{i}": t[:, j].contiguous() for i, t in enumerate(on_host)}
            _write_atomically(block_file(self.options.path, block_hash), tensors)
            self._report.bytes_saved += sum(t.numel() * t.element_size() for t in tensors.values())
        self._report.seconds += time.perf_counter() - start

    def get_finished(self) -> KVTransferReport:
        report, self._report = self._report, KVTransferReport()
        return report


def _write_atomically(name: str, tensors: dict[str, torch.Tensor]) -> None:
    # Readers (other instances, the scheduler's existence check) must never see a partial file;
    # the dot prefix keeps the temporary out of "*.safetensors" listings.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(name), prefix=".", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, name)
    except BaseException:
        os.unlink(tmp)
        raise


KV_CONNECTOR = KVConnector(scheduler=DiskScheduler, worker=DiskWorker)
