"""Tiered offload KV connector: prompt KV kept in host RAM, then on disk, and loaded back on a prefix hit.

Every full prompt block the engine computes is saved, keyed by its prefix hash
(``fw.sdk.block_hash.block_hash_chain`` over the prompt, its ``cache_salt`` included), into a
RAM tier of at most ``cpu_bytes``. Past that, the tier's least recently used
blocks spill to a disk tier of at most ``disk_bytes`` (one file per block
under ``path``), whose least recently used files are deleted in turn. A block
lives in one tier at a time; looking it up, or computing it again, makes it
the most recently used of its tier. A long shared prefix that the primary
pool's prefix cache lost under memory pressure thus comes back from RAM or
disk instead of being recomputed.

Both halves share one ``TieredStore`` per directory in the process: the
scheduler half looks blocks up in it, the worker half moves their data. The
interface gives the scheduler half no channel to worker state (nor a block's
size in bytes), so this needs the worker in the engine process, which is
where it runs: the engine refuses KV connectors with tensor or pipeline
parallelism. A lock file keeps other processes off the directory.

Loads are asynchronous. A block in RAM is copied into the KV cache at once,
in ``start_load_kv``; a block on disk is read and checked on an I/O thread,
and copied in by the first ``get_finished`` after the read, which reports the
request loaded: the engine loop never waits on a disk read. A load that
outlasts ``timeout`` is reported failed, and the engine computes the tokens.
Every file operation (write, read, delete) runs on that one thread in
submission order, so a block is never read before its write, nor deleted
under a queued read.

A file holds a header (magic, the cache layout's checksum, the payload's
CRC-32 and length), then the block's bytes for every layer. A file that is
missing, short, of another layout or fails its CRC fails the request's load
(the engine recomputes the tokens) and leaves the store; the recompute saves
the block again.

Memory: the RAM tier holds at most ``cpu_bytes``. Spilled blocks stay in
memory until written; when those exceed ``cpu_bytes`` too, the step waits for
the writes (with ``cpu_bytes`` 0, every write completes within its step).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
import weakref
import zlib
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import torch

from fw.interfaces.kvconnector import (
    KVConnector,
    KVConnectorWorker,
    KVTransferReport,
    PrefixBlockMeta,
    PrefixBlockScheduler,
    SavedBlocks,
)
from fw_kvconnector_offload.spec import OffloadOptions

log = logging.getLogger("fw")

SUFFIX = ".fwkv"
_MAGIC = b"FWKV"
_HEADER = struct.Struct("<4sIIQ")  # magic, layout checksum, payload CRC-32, payload length


def block_file(root: str, block_hash: int) -> str:
    return os.path.join(root, f"{block_hash:016x}{SUFFIX}")


def write_block(name: str, layout: int, data: torch.Tensor) -> None:
    payload = data.numpy()
    with open(name, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, layout, zlib.crc32(payload), payload.nbytes))
        f.write(payload)


def read_block(name: str, layout: int, nbytes: int) -> torch.Tensor:
    """The block's bytes; ValueError for a file that is not one whole, intact block of this layout."""
    with open(name, "rb") as f:
        buf = bytearray(_HEADER.size + nbytes)
        got = f.readinto(buf)
        extra = f.read(1)
    if got != len(buf) or extra:
        raise ValueError(f"{name}: not {len(buf)} bytes long, the size of a block file of this cache")
    magic, file_layout, crc, length = _HEADER.unpack_from(buf)
    if magic != _MAGIC or file_layout != layout or length != nbytes:
        raise ValueError(f"{name}: not a block file of this cache's layout")
    if zlib.crc32(memoryview(buf)[_HEADER.size :]) != crc:
        raise ValueError(f"{name}: checksum mismatch")
    return torch.frombuffer(buf, dtype=torch.uint8, offset=_HEADER.size)


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


def _close(io: ThreadPoolExecutor, lock: int) -> None:
    io.shutdown(wait=True)
    os.close(lock)


class TieredStore:
    """Both tiers of one directory: the RAM tier's blocks and the disk tier's index. Engine thread only.

    ``ram``: hash -> the block's bytes; ``disk``: hash -> its file's size; each least recently used first.
    """

    _open: ClassVar[weakref.WeakValueDictionary[str, TieredStore]] = weakref.WeakValueDictionary()

    @classmethod
    def open(cls, options: OffloadOptions) -> TieredStore:
        """The store of ``options.path`` in this process, shared by the two halves of a connector."""
        path = os.path.realpath(options.path)
        store = cls._open.get(path)
        if store is None:
            store = cls._open[path] = cls(path, options.cpu_bytes, options.disk_bytes)
        elif (store.cpu_bytes, store.disk_bytes) != (options.cpu_bytes, options.disk_bytes):
            raise ValueError(
                f"KV connector offload: {path} is in use in this process with cpu_bytes {store.cpu_bytes} and "
                f"disk_bytes {store.disk_bytes}; give each engine its own path"
            )
        return store

    def __init__(self, path: str, cpu_bytes: int, disk_bytes: int) -> None:
        self.path, self.cpu_bytes, self.disk_bytes = path, cpu_bytes, disk_bytes
        self.ram: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.disk: OrderedDict[int, int] = OrderedDict()
        self.ram_used = self.disk_used = 0
        self.layout: tuple[int, int] | None = None  # (layout checksum, bytes per block), from the worker's caches
        self._writes: deque[tuple[Future, int, int]] = deque()  # spills on their way to disk: (write, hash, bytes)
        self._writing = 0  # their bytes
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fw-kv-offload-io")  # one: ops stay in order
        os.makedirs(path, exist_ok=True)
        lock = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            self._io.shutdown()
            raise RuntimeError(
                f"KV connector offload: another process uses {path}; give each engine its own path"
            ) from None
        weakref.finalize(self, _close, self._io, lock)
        # An earlier run's files: their blocks may be another model's, which nothing in them tells.
        for name in os.listdir(path):
            if name.endswith(SUFFIX):
                os.unlink(os.path.join(path, name))

    def bind(self, layout: int, block_bytes: int) -> None:
        if self.layout not in (None, (layout, block_bytes)):
            raise RuntimeError(
                f"KV connector offload: {self.path} holds another model's KV; give each model its own path"
            )
        self.layout = (layout, block_bytes)

    def where(self, block_hash: int) -> str | None:
        """The tier holding the block, ``cpu`` or ``disk``, where it is now the most recently used; else None."""
        for tier, blocks in (("cpu", self.ram), ("disk", self.disk)):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
                return tier
        return None

    def put(self, block_hash: int, data: torch.Tensor) -> None:
        """Keep a block (its bytes, on the host) in RAM, spilling the least recently used ones to disk."""
        if self.where(block_hash) is not None:
            return
        if data.nbytes > self.cpu_bytes:
            self._to_disk(block_hash, data)
            return
        self.ram[block_hash] = data
        self.ram_used += data.nbytes
        while self.ram_used > self.cpu_bytes:
            spilled_hash, spilled = self.ram.popitem(last=False)
            self.ram_used -= spilled.nbytes
            self._to_disk(spilled_hash, spilled)

    def _to_disk(self, block_hash: int, data: torch.Tensor) -> None:
        size = _HEADER.size + data.nbytes
        if size > self.disk_bytes:
            return  # no disk tier, or one smaller than a block: the block is dropped
        while self.disk_used + size > self.disk_bytes:
            self._delete(next(iter(self.disk)))
        self.disk[block_hash] = size
        self.disk_used += size
        write = self._io.submit(write_block, block_file(self.path, block_hash), self.layout[0], data)
        self._writes.append((write, block_hash, data.nbytes))
        self._writing += data.nbytes

    def _delete(self, block_hash: int) -> None:
        self.disk_used -= self.disk.pop(block_hash)
        self._io.submit(_unlink, block_file(self.path, block_hash))  # after any queued read of it

    def drop(self, block_hash: int) -> None:
        """Forget a block whose file proved unusable, and delete the file."""
        if block_hash in self.disk:
            self._delete(block_hash)

    def read(self, block_hash: int) -> Future[torch.Tensor]:
        return self._io.submit(read_block, block_file(self.path, block_hash), *self.layout)

    def wait_writes(self, limit: int) -> None:
        """Settle finished writes, and wait for the oldest while more than ``limit`` bytes are on their way to disk."""
        while self._writes and (self._writes[0][0].done() or self._writing > limit):
            write, block_hash, nbytes = self._writes.popleft()
            self._writing -= nbytes
            try:
                write.result()
            except OSError as exc:
                log.warning("KV connector offload: block %016x not written: %s", block_hash, exc)
                self.drop(block_hash)


class OffloadScheduler(PrefixBlockScheduler):
    load_async = True

    def __init__(self, options: OffloadOptions | None, block_size: int) -> None:
        super().__init__(options or OffloadOptions(), block_size)
        self.store = TieredStore.open(self.options)

    def stored_prefix(self, hashes: list[int]) -> int:
        count = 0
        while count < len(hashes) and self.store.where(hashes[count]) is not None:
            count += 1
        return count

    def should_save(self, block_hash: int) -> bool:
        # A block the store holds (loaded, or another request's) only becomes its tier's most recently used.
        return self.store.where(block_hash) is None


@dataclass
class _Load:
    reads: list[tuple[int, int, Future]]  # (block_id, block_hash, its bytes read from disk)
    from_ram: int  # blocks already copied from the RAM tier
    start: float


class OffloadWorker(KVConnectorWorker):
    def __init__(self, options: OffloadOptions | None) -> None:
        super().__init__(options or OffloadOptions())
        self.store = TieredStore.open(self.options)
        self.kv_caches: list[torch.Tensor] = []
        self.loaded_blocks: Counter[str] = Counter()  # tier -> blocks loaded into the cache by completed loads
        self._loads: dict[str, _Load] = {}
        self._saved = SavedBlocks()
        self._report = KVTransferReport()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        layout = repr([(tuple(c[:, 0].shape), str(c.dtype)) for c in kv_caches])
        self.block_bytes = sum(c[:, 0].nbytes for c in kv_caches)
        self.store.bind(zlib.crc32(layout.encode()), self.block_bytes)

    def start_load_kv(self, meta: PrefixBlockMeta) -> None:
        for request_id, blocks in meta.loads:
            start, reads, from_ram = time.perf_counter(), [], 0
            for block_id, block_hash in blocks:
                # The scheduler found every block in the store this step, and nothing leaves it before the saves.
                if self.store.where(block_hash) == "cpu":
                    self._copy_in(block_id, self.store.ram[block_hash])
                    from_ram += 1
                else:
                    reads.append((block_id, block_hash, self.store.read(block_hash)))
            self._loads[request_id] = _Load(reads, from_ram, start)

    def _copy_in(self, block_id: int, data: torch.Tensor) -> None:
        offset = 0
        for cache in self.kv_caches:
            dst = cache[:, block_id]
            dst.copy_(data[offset : offset + dst.nbytes].view(dst.dtype).view(dst.shape))
            offset += dst.nbytes

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, meta: PrefixBlockMeta) -> None:
        if meta.saves:  # into the store in wait_for_save
            self._saved.gather(layer_idx, kv_cache, [block_id for _, block_id, _ in meta.saves], meta.saves)

    def wait_for_save(self) -> None:
        start = time.perf_counter()
        on_host, saves = self._saved.take(len(self.kv_caches))
        for j, (_, _, block_hash) in enumerate(saves):
            self.store.put(block_hash, torch.cat([t[:, j].reshape(-1).view(torch.uint8) for t in on_host]))
            self._report.bytes_saved += self.block_bytes
        self.store.wait_writes(self.store.cpu_bytes)
        self._report.seconds += time.perf_counter() - start

    def get_finished(self) -> KVTransferReport:
        report, self._report = self._report, KVTransferReport()
        now = time.perf_counter()
        for request_id, load in list(self._loads.items()):
            if not all(future.done() for _, _, future in load.reads):
                if now - load.start > self.options.timeout:
                    # Reads never touch the cache (get_finished copies), so abandoning them is safe.
                    del self._loads[request_id]
                    log.warning(
                        "KV connector offload: request %s: no KV from disk after %.1f s; computing it",
                        request_id,
                        self.options.timeout,
                    )
                    report.failed.add(request_id)
                continue
            del self._loads[request_id]
            bad = [(block_hash, future.exception()) for _, block_hash, future in load.reads if future.exception()]
            for block_hash, exc in bad:
                log.warning(
                    "KV connector offload: request %s computes its prompt: block %016x: %s", request_id, block_hash, exc
                )
                self.store.drop(block_hash)
            if bad:
                report.failed.add(request_id)
                continue
            for block_id, _, future in load.reads:
                self._copy_in(block_id, future.result())
            self.loaded_blocks["cpu"] += load.from_ram
            self.loaded_blocks["disk"] += len(load.reads)
            report.loaded.add(request_id)
            report.bytes_loaded += (load.from_ram + len(load.reads)) * self.block_bytes
            report.seconds += time.perf_counter() - load.start
        return report

    def shutdown(self) -> None:
        self.store.wait_writes(0)


KV_CONNECTOR = KVConnector(scheduler=OffloadScheduler, worker=OffloadWorker)
