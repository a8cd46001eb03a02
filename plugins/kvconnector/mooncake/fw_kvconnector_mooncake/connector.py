"""Mooncake KV connector, in one of two modes (the options' ``mode``).

``transfer``: p2p's connector, the block bytes moved by Mooncake's Transfer
Engine. All but the bytes is fw-kvconnector-p2p's: the producer keeps prompt
blocks in its bounded buffer and answers ``hello`` and ``have`` on its side
channel; the consumer's scheduler looks prefixes up there, and its worker
pulls in pool threads, gives up past ``timeout`` and lets the engine compute
the tokens.

A pull asks the producer to ``stage`` the blocks: the producer copies them
into one buffer, registers it with its Transfer Engine and answers with its
engine's session and the buffer's address. The consumer reads it with
``transfer_sync_read`` into a buffer of its own, says ``done``, and the
producer unregisters and drops the copy (also when the consumer hangs up, or
after the ``hold`` seconds that the consumer gives).

Why a staged copy rather than the buffer's blocks in place: the buffer may drop
a block while a consumer reads it; a copy belongs to one pull. Why not read
straight into the KV cache: a read cannot be cancelled, and a load abandoned at
its timeout gives its blocks back to the engine; so it lands in the pull's own
buffer, which p2p copies into the cache on the engine's thread.

``store``: a Mooncake Store pool, which ``mooncake_master`` keeps the index of
and the instances' memory holds (each adds ``segment_mb``). Every instance
saves the prompt blocks it computes under ``<namespace>-<prefix hash>`` (the
core's ``PrefixBlockScheduler``: ``fw.sdk.block_hash.block_hash_chain``, the prompt's
``cache_salt`` included), and looks its prompts up there. The prompt's last,
partial block is saved too, as p2p's producer keeps it, so a hit leaves only
the prompt's last token to compute. Loads are p2p's asynchronous pulls, the
bytes read by ``batch_get_into`` in a pool thread; saves complete within their
step, so a prefill's blocks are in the pool when its answer leaves.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

# Read when mooncake loads: its INFO log speaks on every new peer.
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from mooncake.engine import TransferEngine  # noqa: E402
from mooncake.store import MooncakeDistributedStore  # noqa: E402

from fw.interfaces.kvconnector import (  # noqa: E402
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferReport,
    PrefixBlockMeta,
    PrefixBlockScheduler,
    SavedBlocks,
)
from fw.sdk.side_channel import (  # noqa: E402
    BlockBuffer,
    P2PScheduler,
    SideChannel,
    SideChannelWorker,
    recv_message,
    send_message,
)
from fw_kvconnector_mooncake.spec import MooncakeOptions  # noqa: E402

log = logging.getLogger("fw")


def _bound_stalls(options: MooncakeOptions) -> None:
    # Without it a transfer from a peer that stopped answering never returns, and holds its thread for good.
    # Read when a Transfer Engine starts; the first one's value holds for the process unless the variable is set already.
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(math.ceil(options.timeout)))


# --- mode transfer: the side channel (fw.sdk.side_channel), the bytes read by the Transfer Engine ---------------------------------


def start_engine(options: MooncakeOptions) -> TransferEngine:
    _bound_stalls(options)
    engine = TransferEngine()
    # P2PHANDSHAKE: peers exchange their memory segments directly, no metadata server.
    if engine.initialize(options.host, "P2PHANDSHAKE", options.protocol, options.device_name) != 0:
        raise RuntimeError(f"Mooncake's Transfer Engine did not start on {options.host} over {options.protocol}")
    return engine


class MooncakeSideChannel(SideChannel):
    """the side channel (fw.sdk.side_channel), and ``stage``: blocks copied into a registered buffer for a consumer's engine to read."""

    def __init__(self, engine: TransferEngine, session: str, *args: Any) -> None:
        self.engine, self.session = engine, session
        super().__init__(*args)

    def _answer(self, conn: socket.socket, header: dict[str, Any]) -> None:
        if header.get("op") != "stage":
            super()._answer(conn, header)
            return
        blocks = self.buffer.get(header["hashes"])
        if blocks is None:
            send_message(conn, {"error": "blocks no longer held (dropped from the producer's buffer)"})
            return
        staged = np.frombuffer(b"".join(blocks), dtype=np.uint8)
        address = staged.ctypes.data
        if self.engine.register_memory(address, staged.nbytes) != 0:
            send_message(conn, {"error": "the Transfer Engine did not register the staged blocks"})
            return
        try:
            send_message(conn, {"session": self.session, "address": address})
            # Past ``hold`` the consumer has given up on this pull (its clock started first): it will not use
            # what it reads, so the copy can go. A timeout or a hang-up raises, and _serve drops the connection.
            conn.settimeout(float(header["hold"]))
            recv_message(conn)  # done
            conn.settimeout(None)
        finally:
            self.engine.unregister_memory(address)


class TransferWorker(SideChannelWorker):
    name = "mooncake"

    def __init__(self, options: MooncakeOptions | None) -> None:
        super().__init__(options or MooncakeOptions())
        self.engine: TransferEngine | None = None

    def register_kv_caches(self, kv_caches: list) -> None:
        self.engine = start_engine(self.options)  # before the side channel, which hands out its session
        super().register_kv_caches(kv_caches)

    def _side_channel(self, buffer: BlockBuffer) -> SideChannel:
        session = f"{self.options.host}:{self.engine.get_rpc_port()}"
        return MooncakeSideChannel(self.engine, session, self.options.host, self.options.port, buffer, self.layout)

    def _fetch(self, sock: socket.socket, hello: dict[str, Any], hashes: list[int], nbytes: int) -> np.ndarray:
        send_message(sock, {"op": "stage", "hashes": hashes, "hold": self.options.timeout})
        reply, _ = recv_message(sock)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        data = np.empty(nbytes, dtype=np.uint8)
        address = data.ctypes.data
        if self.engine.register_memory(address, nbytes) != 0:  # RDMA writes only into registered memory
            raise RuntimeError("the Transfer Engine did not register the receive buffer")
        try:
            status = self.engine.transfer_sync_read(reply["session"], address, reply["address"], nbytes)
        finally:
            self.engine.unregister_memory(address)
        if status != 0:
            raise RuntimeError(f"Mooncake's read of {nbytes} bytes from {reply['session']} failed ({status})")
        send_message(sock, {"op": "done"})
        return data

    def shutdown(self) -> None:
        super().shutdown()
        self.engine = None  # the engine closes its ports once the last pull or staged read lets go of it


# --- mode store: a Mooncake Store pool, blocks keyed by their prefix hash --------------------------------------


class StoreDown(ConnectionError):
    """The store failed a moment ago, or a call to it still runs: not asked."""


def _close_client(thread: ThreadPoolExecutor, store: MooncakeDistributedStore) -> None:
    thread.shutdown(wait=True)  # a late call finishes first
    store.close()


class StoreClient:
    """A Mooncake Store client that adds ``segment_bytes`` of this host's memory to the pool.

    ``call`` runs one operation at a time on the client's own thread and waits for it ``timeout`` seconds at most:
    Mooncake waits 30 s for a master that stopped answering, which must hold that thread, not the engine's. After
    a failure, and while a late call still runs, the store counts as down for ``timeout`` seconds: calls raise
    ``StoreDown`` at once. The client leaves the pool (its memory with it) once nothing refers to it.
    """

    def __init__(self, options: MooncakeOptions, segment_bytes: int) -> None:
        self.options = options
        host, _, port = options.master.rpartition(":")
        # Mooncake's setup retries a master that does not answer for about 90 s: ask first, and say what is wrong.
        try:
            socket.create_connection((host, int(port)), timeout=options.timeout).close()
        except OSError as exc:
            raise RuntimeError(
                f"KV connector mooncake: no mooncake_master answers at {options.master} ({exc}); start one, or "
                "fix kv_connector.master"
            ) from None
        _bound_stalls(options)
        self.store = MooncakeDistributedStore()
        # No local buffer (0): transfers go from and into memory of ours (put_from, get_into), never through it.
        status = self.store.setup(
            options.host,
            options.metadata_server,
            segment_bytes,
            0,
            options.protocol,
            options.device_name,
            options.master,
        )
        if status != 0:
            raise RuntimeError(
                f"KV connector mooncake: the Mooncake Store client did not start ({status}): master "
                f"{options.master}, metadata server {options.metadata_server}, {options.protocol} on {options.host}"
            )
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fw-kv-mooncake-store")
        self._last: Future | None = None
        self._down_until = 0.0  # time.monotonic() before which the store is not asked
        weakref.finalize(self, _close_client, self._thread, self.store)

    def key(self, block_hash: int) -> str:
        return f"{self.options.namespace}-{block_hash:016x}"

    def call(self, operation: Callable[[], list[int]]) -> list[int]:
        """``operation``'s codes, one per key; raises if one is an error (negative) or the call outlasts ``timeout``."""
        if time.monotonic() < self._down_until or (self._last is not None and not self._last.done()):
            raise StoreDown(f"the store at {self.options.master} failed less than {self.options.timeout:g} s ago")
        self._last = self._thread.submit(operation)
        try:
            codes = self._last.result(timeout=self.options.timeout)
            if min(codes, default=0) < 0:
                raise RuntimeError(f"Mooncake's codes {sorted(set(codes))}")
        except Exception as exc:
            self._down_until = time.monotonic() + self.options.timeout
            if isinstance(exc, TimeoutError):
                raise RuntimeError(f"no answer in {self.options.timeout:g} s") from None
            raise
        return codes


class StoreScheduler(PrefixBlockScheduler):
    load_async = True
    partial_blocks = True  # a hit leaves only the prompt's last token to compute
    REMEMBERED = 1 << 16  # block hashes that lookups found, kept so as not to put them again

    def __init__(self, options: MooncakeOptions, block_size: int) -> None:
        super().__init__(options, block_size)
        # Its own client, adding no memory: nothing says the worker half runs in this process.
        self.client = StoreClient(options, 0)
        self._found: OrderedDict[int, None] = OrderedDict()

    def stored_prefix(self, hashes: list[int]) -> int:
        keys, store = [self.client.key(h) for h in hashes], self.client.store
        try:
            # The operation holds the store, not its client: a client must never go on its own thread.
            found = self.client.call(lambda: store.batch_is_exist(keys))
        except StoreDown:
            return 0
        except Exception as exc:  # noqa: BLE001 - a store that does not answer is a miss
            log.warning("KV connector mooncake: no lookup in the store at %s: %s", self.options.master, exc)
            return 0
        count = found.index(0) if 0 in found else len(found)
        for block_hash in hashes[:count]:
            self._found[block_hash] = None
            self._found.move_to_end(block_hash)
        while len(self._found) > self.REMEMBERED:
            self._found.popitem(last=False)
        return count

    def should_save(self, block_hash: int) -> bool:
        return block_hash not in self._found  # what a load brought in is in the store already


def _put(store: MooncakeDistributedStore, keys: list[str], data: torch.Tensor) -> list[int]:
    address, size = data.data_ptr(), data.shape[1]
    if store.register_buffer(address, data.nbytes) != 0:  # RDMA sends only from registered memory
        return [-1]
    try:
        return store.batch_put_from(keys, [address + i * size for i in range(len(keys))], [size] * len(keys))
    finally:
        store.unregister_buffer(address)


class StoreWorker(KVConnectorWorker):
    name = "mooncake store"

    # p2p's asynchronous loads, as they are: ``_pull`` reads a request's blocks in a pool thread, and the engine's
    # thread copies them into the KV cache, or reports the load failed past ``timeout``.
    start_load_kv = SideChannelWorker.start_load_kv
    get_finished = SideChannelWorker.get_finished
    _copy_in = SideChannelWorker._copy_in

    def __init__(self, options: MooncakeOptions) -> None:
        super().__init__(options)
        self.kv_caches: list[torch.Tensor] = []
        self.client: StoreClient | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pulls: dict = {}
        self._saved = SavedBlocks()
        self._report = KVTransferReport()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.block_bytes = sum(c[:, 0].nbytes for c in kv_caches)
        self.client = StoreClient(self.options, self.options.segment_mb << 20)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fw-kv-mooncake-get")

    def _pull(self, hashes: list[int]) -> np.ndarray:
        """The blocks' bytes, in order (runs in a pool thread; never touches the KV cache)."""
        client, count, size = self.client, len(hashes), self.block_bytes
        data = np.empty(count * size, dtype=np.uint8)
        address = data.ctypes.data
        if client.store.register_buffer(address, data.nbytes) != 0:  # RDMA reads only into registered memory
            raise RuntimeError("Mooncake did not register the receive buffer")
        try:
            got = client.store.batch_get_into(
                [client.key(h) for h in hashes], [address + i * size for i in range(count)], [size] * count
            )
        finally:
            client.store.unregister_buffer(address)
        if got != [size] * count:
            # Negative: Mooncake's error (a block evicted since the lookup, the master gone); another size: the KV
            # of another model under the same namespace.
            raise RuntimeError(f"reading {count} blocks of {size} bytes from the store returned {sorted(set(got))}")
        return data

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, meta: PrefixBlockMeta) -> None:
        if meta.saves:  # put in wait_for_save
            self._saved.gather(layer_idx, kv_cache, [block_id for _, block_id, _ in meta.saves], meta.saves)

    def wait_for_save(self) -> None:
        start = time.perf_counter()
        on_host, saves = self._saved.take(len(self.kv_caches))
        if not saves:
            return
        count, client, store = len(saves), self.client, self.client.store
        # A row per block, every layer's bytes in turn: what _copy_in takes.
        data = torch.cat([t.transpose(0, 1).reshape(count, -1).view(torch.uint8) for t in on_host], dim=1)
        keys = [client.key(block_hash) for _, _, block_hash in saves]
        try:
            client.call(lambda: _put(store, keys, data))  # holds data for a late put, and not the client
        except StoreDown:
            return  # a cache: the blocks are computed again when asked for
        except Exception as exc:  # noqa: BLE001
            log.warning("KV connector mooncake: %d blocks not saved to the store: %s", count, exc)
            return
        self._report.bytes_saved += data.nbytes
        self._report.seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.client = None  # leaves the pool once no pull holds it


# --- either mode -------------------------------------------------------------------------------------------------
# The engine takes one scheduler class and one worker class per connector; these build the halves of the mode.


class MooncakeScheduler(KVConnectorScheduler):
    def __new__(cls, options: MooncakeOptions | None, block_size: int) -> KVConnectorScheduler:
        store = options is not None and options.mode == "store"
        return (StoreScheduler if store else P2PScheduler)(options, block_size)


class MooncakeWorker(KVConnectorWorker):
    def __new__(cls, options: MooncakeOptions | None) -> KVConnectorWorker:
        return (StoreWorker if options is not None and options.mode == "store" else TransferWorker)(options)


KV_CONNECTOR = KVConnector(scheduler=MooncakeScheduler, worker=MooncakeWorker)
