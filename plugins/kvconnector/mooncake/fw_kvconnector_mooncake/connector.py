"""Mooncake KV connector: p2p's connector, the block bytes moved by Mooncake's Transfer Engine.

All but the bytes is fw-kvconnector-p2p's: the producer keeps prompt blocks in
its bounded buffer and answers ``hello`` and ``have`` on its side channel; the
consumer's scheduler looks prefixes up there, and its worker pulls in pool
threads, gives up past ``timeout`` and lets the engine compute the tokens.

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
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import numpy as np

# Read when mooncake loads: its INFO log speaks on every new peer.
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from mooncake.engine import TransferEngine  # noqa: E402

from fw.interfaces.kvconnector import KVConnector  # noqa: E402
from fw_kvconnector_mooncake.spec import MooncakeOptions  # noqa: E402
from fw_kvconnector_p2p.connector import (  # noqa: E402
    BlockBuffer,
    P2PScheduler,
    SideChannel,
    SideChannelWorker,
    recv_message,
    send_message,
)


def start_engine(options: MooncakeOptions) -> TransferEngine:
    # Without it a transfer from a peer that stopped answering never returns, and holds its pull thread for good.
    # Read at initialize; the first engine's value holds for the process unless the variable is set already.
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(math.ceil(options.timeout)))
    engine = TransferEngine()
    # P2PHANDSHAKE: peers exchange their memory segments directly, no metadata server.
    if engine.initialize(options.host, "P2PHANDSHAKE", options.protocol, options.device_name) != 0:
        raise RuntimeError(f"Mooncake's Transfer Engine did not start on {options.host} over {options.protocol}")
    return engine


class MooncakeSideChannel(SideChannel):
    """p2p's side channel, and ``stage``: blocks copied into a registered buffer for a consumer's engine to read."""

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


class MooncakeWorker(SideChannelWorker):
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


KV_CONNECTOR = KVConnector(scheduler=P2PScheduler, worker=MooncakeWorker)
