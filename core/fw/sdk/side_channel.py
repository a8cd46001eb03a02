"""The side channel of prompt-KV connectors: a prefill instance (producer) serves its prompt blocks to decode
instances (consumers), the transport of the bytes left to each connector (``SideChannelWorker._fetch``).

The producer's worker keeps a copy of every prompt block it computes in a
bounded buffer (least recently used dropped first), keyed by the block's
prefix hash, and serves it on a side channel (a TCP socket, ``host:port``).
Its blocks in the KV cache are never held for a consumer, so a consumer that
dies or never comes costs the producer nothing but buffer space.

The consumer's scheduler asks the side channel which of a prompt's prefix
hashes the producer holds (``have``); the request then waits while its
worker pulls those blocks (``get``) in a background thread, and runs once
they are copied into its cache. A lookup that fails is a miss; a pull that
fails or outlasts ``timeout`` is reported failed and the engine computes
the tokens. The hash chain covers the prompt but its last token, the last
(partial) block included, so a consumer computes only that one token.

Side channel messages are a 4-byte length and a JSON header, then
``payload`` bytes of raw block data. The handshake (``hello``) exchanges
host ids and the per-layer block layout: blocks only move between caches of
the same layout, and over shared memory (a file in /dev/shm that the
consumer creates and the producer writes) when both run on one host. The
p2p, mooncake and nixl connectors are built on it.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from fw.interfaces.kvconnector import (
    KVConnectorWorker,
    KVTransferReport,
    PrefixBlockMeta,
    PrefixBlockScheduler,
    SavedBlocks,
)
from fw.sdk.side_channel_options import SideChannelOptions

log = logging.getLogger("fw")

_LENGTH = struct.Struct("!I")
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "fw-kv-p2p-"


def host_id() -> str:
    """Equal for two processes that share this host's /dev/shm (hostname and boot id)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


# --- the side channel's wire format ------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the peer closed the side channel")
        got += k
    return buf


def send_message(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    data = json.dumps({**header, "payload": len(payload)}).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)
    if payload:
        sock.sendall(payload)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    header = json.loads(_recv_exact(sock, size))
    return header, _recv_exact(sock, header["payload"])


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed its end (a peek that would otherwise wait finds the end of the stream)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def sweep_shm() -> None:
    """Remove the /dev/shm files of consumers that died mid-pull, where the producer could not tell (their pid
    follows the prefix)."""
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*-*") if SHM_DIR.is_dir() else ():
        pid = path.name[len(SHM_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


def _connect(peer: str, timeout: float) -> socket.socket:
    host, _, port = peer.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


# --- producer: the buffer and the server ---------------------------------------


class BlockBuffer:
    """Block hash -> the block's bytes (every layer), least recently used dropped past ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def put(self, block_hash: int, data: bytes) -> None:
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            self._size += len(data) - (len(old) if old is not None else 0)
            self._blocks[block_hash] = data
            while self._size > self.capacity:
                self._size -= len(self._blocks.popitem(last=False)[1])

    def count_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are held (a prefix chain: nothing past a missing one is usable)."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._blocks:
                    break
                self._blocks.move_to_end(h)
                n += 1
            return n

    def get(self, hashes: Sequence[int]) -> list[bytes] | None:
        with self._lock:
            if any(h not in self._blocks for h in hashes):
                return None
            return [self._blocks[h] for h in hashes]


class SideChannel:
    """The producer's server: ``hello``, ``have`` and ``get`` on a listening socket, one thread per connection."""

    def __init__(self, host: str, port: int, buffer: BlockBuffer, layout: list) -> None:
        self.buffer, self.layout = buffer, layout
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, name="fw-kv-p2p-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="fw-kv-p2p-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    header, _ = recv_message(conn)
                    self._answer(conn, header)
            except (ConnectionError, OSError, ValueError):
                return  # the peer went away or spoke nonsense: its requests time out on its side

    def _answer(self, conn: socket.socket, header: dict[str, Any]) -> None:
        op = header.get("op")
        if op == "hello":
            send_message(conn, {"host": host_id(), "layout": self.layout})
        elif op == "have":
            send_message(conn, {"count": self.buffer.count_prefix(header["hashes"])})
        elif op == "get":
            blocks = self.buffer.get(header["hashes"])
            if blocks is None:
                send_message(conn, {"error": "blocks no longer held (dropped from the producer's buffer)"})
            elif header.get("shm"):
                self._write_shm(conn, header["shm"], blocks)
            else:
                send_message(conn, {"ok": True}, b"".join(blocks))
        else:
            send_message(conn, {"error": f"unknown op {op!r}"})

    @staticmethod
    def _write_shm(conn: socket.socket, name: str, blocks: list[bytes]) -> None:
        path = SHM_DIR / name
        if path.parent != SHM_DIR or not name.startswith(SHM_PREFIX):  # only files a consumer made for this
            send_message(conn, {"error": f"shm: {name!r} is not a {SHM_PREFIX}* file name"})
            return
        try:
            with open(path, "r+b") as f:
                for block in blocks:
                    f.write(block)
        except OSError as exc:
            send_message(conn, {"error": f"shm: {exc}"})
            return
        if _hung_up(conn):  # the consumer died mid-pull: nobody else would free its memory
            path.unlink(missing_ok=True)
            return
        send_message(conn, {"ok": True})

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone leaves it listening)
        self.sock.close()


# --- the two halves --------------------------------------------------------------


class P2PScheduler(PrefixBlockScheduler):
    load_async = True
    # The producer keeps the prompt's last, partial block too: a consumer computes only the prompt's last token.
    partial_blocks = True

    def __init__(self, options: SideChannelOptions | None, block_size: int) -> None:
        super().__init__(options or SideChannelOptions(), block_size)
        self._peer: socket.socket | None = None
        self._down_until = 0.0  # time.monotonic() before which the producer is not asked (it failed to answer)

    @property
    def loads_kv(self) -> bool:
        return super().loads_kv and self.options.peer is not None

    def _ask(self, header: dict[str, Any]) -> dict[str, Any]:
        """One request on the side channel. A kept connection may have gone stale (a producer restart): then once
        more on a new one. After a failure the producer counts as down for ``timeout`` seconds: lookups run on the
        scheduler's thread, and a silent producer must cost one admission a wait, not every admission."""
        if time.monotonic() < self._down_until:
            raise ConnectionError(f"the producer did not answer in the last {self.options.timeout:g} s")
        kept = self._peer is not None
        try:
            try:
                return self._request(header)
            except OSError as exc:
                if not kept or isinstance(exc, TimeoutError):
                    raise
                return self._request(header)
        except OSError:
            self._down_until = time.monotonic() + self.options.timeout
            raise

    def _request(self, header: dict[str, Any]) -> dict[str, Any]:
        try:
            if self._peer is None:
                self._peer = _connect(self.options.peer, self.options.timeout)
            send_message(self._peer, header)
            return recv_message(self._peer)[0]
        except OSError:
            if self._peer is not None:
                self._peer.close()
                self._peer = None
            raise

    def stored_prefix(self, hashes: list[int]) -> int:
        try:
            return int(self._ask({"op": "have", "hashes": hashes})["count"])
        except (OSError, KeyError, ValueError) as exc:  # an unreachable producer is a miss
            log.warning("KV connector p2p: cannot reach the producer at %s: %s", self.options.peer, exc)
            return 0


@dataclass
class _Pull:
    blocks: tuple[tuple[int, int], ...]
    future: Future
    start: float


class SideChannelWorker(KVConnectorWorker):
    """The worker half of a connector built on the side channel. A subclass says how a consumer moves the
    blocks' bytes (``_fetch``) and may answer more ops on the producer's side channel (``_side_channel``)."""

    name: ClassVar[str]  # in log messages

    def __init__(self, options: SideChannelOptions) -> None:
        super().__init__(options)
        self.kv_caches: list[torch.Tensor] = []
        self.server: SideChannel | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pulls: dict[str, _Pull] = {}
        self._saved = SavedBlocks()
        self._report = KVTransferReport()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self.layout = [[list(c[:, 0].shape), str(c.dtype)] for c in kv_caches]
        self.block_bytes = sum(c[:, 0].nbytes for c in kv_caches)
        if self.options.role != "consumer":
            self.server = self._side_channel(BlockBuffer(self.options.buffer_mb << 20))
            log.info("KV connector %s: side channel on %s:%d", self.name, self.options.host, self.server.port)
        if self.options.role != "producer" and self.options.peer is not None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fw-kv-p2p-pull")

    def _side_channel(self, buffer: BlockBuffer) -> SideChannel:
        return SideChannel(self.options.host, self.options.port, buffer, self.layout)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- consumer ---

    def start_load_kv(self, meta: PrefixBlockMeta) -> None:
        for request_id, blocks in meta.loads:  # only a consumer's scheduler asks for loads: it has a pool
            future = self._pool.submit(self._pull, [h for _, h in blocks])
            self._pulls[request_id] = _Pull(blocks, future, time.monotonic())

    def _pull(self, hashes: list[int]) -> bytearray:
        """The blocks' bytes, in order (runs in a pool thread; never touches the KV cache)."""
        with _connect(self.options.peer, self.options.timeout) as sock:
            send_message(sock, {"op": "hello", "host": host_id()})
            hello, _ = recv_message(sock)
            if hello["layout"] != self.layout:
                raise RuntimeError(f"the producer's KV blocks are laid out as {hello['layout']}, ours as {self.layout}")
            nbytes = len(hashes) * self.block_bytes
            data = self._fetch(sock, hello, hashes, nbytes)
        if len(data) != nbytes:
            raise RuntimeError(f"the producer sent {len(data)} bytes for {len(hashes)} blocks of {self.block_bytes}")
        return data

    @abstractmethod
    def _fetch(self, sock: socket.socket, hello: dict[str, Any], hashes: list[int], nbytes: int) -> Any:
        """The ``nbytes`` of the blocks ``hashes`` (any object with the buffer protocol), after the handshake
        on ``sock`` (``hello``: the producer's answer)."""

    def get_finished(self) -> KVTransferReport:
        report, self._report = self._report, KVTransferReport()
        now = time.monotonic()
        for request_id, pull in list(self._pulls.items()):
            if pull.future.done():
                del self._pulls[request_id]
                try:
                    self._copy_in(pull.blocks, pull.future.result())
                except Exception as exc:  # noqa: BLE001 - any failure is a miss: the engine computes the tokens
                    log.warning("KV connector %s: request %s computes its prompt: %s", self.name, request_id, exc)
                    report.failed.add(request_id)
                    continue
                report.loaded.add(request_id)
                report.bytes_loaded += len(pull.blocks) * self.block_bytes
                report.seconds += now - pull.start
            elif now - pull.start > self.options.timeout:
                # The pull thread writes no cache, so abandoning it is safe; its socket times out on its own.
                del self._pulls[request_id]
                log.warning(
                    "KV connector %s: request %s: no KV after %.1f s; computing it", self.name, request_id, self.options.timeout
                )
                report.failed.add(request_id)
        return report

    def _copy_in(self, blocks: tuple[tuple[int, int], ...], data: Any) -> None:
        offset = 0
        for block_id, _ in blocks:
            for cache in self.kv_caches:
                dst = cache[:, block_id]
                src = torch.frombuffer(data, dtype=torch.uint8, count=dst.nbytes, offset=offset)
                dst.copy_(src.view(dst.dtype).view(dst.shape))
                offset += dst.nbytes

    # --- producer ---

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, meta: PrefixBlockMeta) -> None:
        if meta.saves and self.server is not None:
            self._saved.gather(layer_idx, kv_cache, [block_id for _, block_id, _ in meta.saves], meta.saves)

    def wait_for_save(self) -> None:
        start = time.perf_counter()
        on_host, saves = self._saved.take(len(self.kv_caches))
        for j, (_, _, block_hash) in enumerate(saves):
            data = b"".join(t[:, j].contiguous().view(torch.uint8).numpy().tobytes() for t in on_host)
            self.server.buffer.put(block_hash, data)
            self._report.bytes_saved += len(data)
        self._report.seconds += time.perf_counter() - start
