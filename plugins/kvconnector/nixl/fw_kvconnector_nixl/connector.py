"""NIXL KV connector: p2p's connector, the block bytes read by NVIDIA's NIXL.

All but the bytes is fw-kvconnector-p2p's: the producer keeps prompt blocks in
its bounded buffer and answers ``hello`` and ``have`` on its side channel; the
consumer's scheduler looks prefixes up there, and its worker pulls in pool
threads, gives up past ``timeout`` and lets the engine compute the tokens.

A pull asks the producer to ``stage`` the blocks: the producer registers the
blocks it holds with its NIXL agent, where they lie, and answers with their
addresses and, as the payload, the agent's partial metadata (how to reach it,
and those registrations). The consumer's agent loads it (``add_remote_agent``:
for an agent it knows already, the registrations are added), posts one READ of
every block into a registered buffer of its own and polls it until it is done
or the pull's ``timeout`` has passed (then releasing it cancels it); it then
says ``done`` and the producer deregisters the blocks (also when the consumer
hangs up, or after the ``hold`` seconds that the consumer gives).

No copy is staged, unlike fw-kvconnector-mooncake: a block is an immutable
``bytes`` that the staging pull holds a reference to, so the buffer may drop it
mid-read without freeing it. Joining 64 MiB of blocks took longer here than
NIXL's read of them. The consumer reads into the pull's own buffer rather than
the KV cache for mooncake's reason: an abandoned load gives its blocks back to
the engine, so p2p copies into the cache on the engine's thread.
"""

from __future__ import annotations

import ipaddress
import os
import select
import socket
import time
import uuid
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():
    # UCX's InfiniBand module crashes every process that loaded it at exit on a host without RDMA (nixl-cu12 1.5.1).
    os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO log speaks on every agent

from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # noqa: E402

from fw.interfaces.kvconnector import KVConnector  # noqa: E402
from fw.sdk.side_channel import (  # noqa: E402
    BlockBuffer,
    P2PScheduler,
    SideChannel,
    SideChannelWorker,
    recv_message,
    send_message,
)
from fw_kvconnector_nixl.spec import NixlOptions  # noqa: E402

# NIXL's progress thread polls UCX without pause (a whole core, even idle), so there is none: each side moves UCX
# only while a pull is in flight, the consumer checking its read, the producer asking for notifications (which
# progresses its worker: a read over TCP needs this side to move) between waits of this long for ``done``.
POLL_SECONDS = 0.0005


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def start_agent(options: NixlOptions) -> nixl_agent:
    peer_host = options.peer.rpartition(":")[0] if options.peer else options.host
    if loopback(options.host) and loopback(peer_host):
        # Every peer is on this host: keep UCX off the network, where it listens on every interface otherwise.
        # Read when UCX starts, with the agent's backend.
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    config = nixl_agent_config(
        backends=[options.backend],
        enable_prog_thread=False,  # see POLL_SECONDS
        # The side channel carries the metadata: no listener. Its connection threads and the pull threads call
        # the one agent at once: every call is serialised (without a listener NIXL's default is no locking).
        enable_listen_thread=False,
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(f"fw-kv-nixl-{uuid.uuid4().hex}", config)
    if options.backend not in agent.backends:  # NIXL only warns about a backend it has no plugin for
        raise RuntimeError(f"NIXL has no backend {options.backend!r} here; it has {agent.get_plugin_list()}")
    return agent


def regions(addresses: list[int], nbytes: int) -> np.ndarray:
    """Host-memory regions of ``nbytes`` each, as NIXL's descriptor lists take them: rows of (address, bytes, device)."""
    return np.array([[address, nbytes, 0] for address in addresses], dtype=np.uint64)


class NixlSideChannel(SideChannel):
    """the side channel (fw.sdk.side_channel), and ``stage``: held blocks registered in place for a consumer's agent to read."""

    def __init__(self, agent: nixl_agent, *args: Any) -> None:
        self.agent = agent
        super().__init__(*args)

    def _answer(self, conn: socket.socket, header: dict[str, Any]) -> None:
        if header.get("op") != "stage":
            super()._answer(conn, header)
            return
        blocks = self.buffer.get(header["hashes"])  # references: the blocks outlive this pull even if dropped
        if blocks is None:
            send_message(conn, {"error": "blocks no longer held (dropped from the producer's buffer)"})
            return
        addresses = [np.frombuffer(block, dtype=np.uint8).ctypes.data for block in blocks]
        try:
            registered = self.agent.register_memory(regions(addresses, len(blocks[0])), "DRAM")
        except Exception as exc:  # noqa: BLE001 - NIXL's errors share no base class; the consumer computes
            send_message(conn, {"error": f"NIXL did not register the blocks: {exc}"})
            return
        try:
            # From the metadata the consumer's agent learns how to reach this one and the blocks' registrations.
            metadata = self.agent.get_partial_agent_metadata(registered, inc_conn_info=True)
            send_message(conn, {"agent": self.agent.name, "addresses": addresses}, metadata)
            # Past ``hold`` the consumer has given up on this pull and cancelled its read (its clock started
            # first): the registrations can go. A timeout or a hang-up raises, and _serve drops the connection.
            deadline = time.monotonic() + float(header["hold"])
            while not select.select([conn], [], [], POLL_SECONDS)[0]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no done from the consumer in {header['hold']} s")
                self.agent.get_new_notifs()
            conn.settimeout(float(header["hold"]))
            recv_message(conn)  # done
            conn.settimeout(None)
        finally:
            self.agent.deregister_memory(registered)


class NixlWorker(SideChannelWorker):
    name = "nixl"

    def __init__(self, options: NixlOptions | None) -> None:
        super().__init__(options or NixlOptions())
        self.agent: nixl_agent | None = None
        self._uncancelled: list[np.ndarray] = []  # buffers of reads NIXL could not cancel: they may still land

    def register_kv_caches(self, kv_caches: list) -> None:
        self.agent = start_agent(self.options)  # before the side channel, which stages with it
        super().register_kv_caches(kv_caches)

    def _side_channel(self, buffer: BlockBuffer) -> SideChannel:
        return NixlSideChannel(self.agent, self.options.host, self.options.port, buffer, self.layout)

    def _fetch(self, sock: socket.socket, hello: dict[str, Any], hashes: list[int], nbytes: int) -> np.ndarray:
        deadline = time.monotonic() + self.options.timeout
        agent = self.agent  # shutdown() lets go of it: this pull keeps it until its read is released
        send_message(sock, {"op": "stage", "hashes": hashes, "hold": self.options.timeout})
        reply, metadata = recv_message(sock)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        agent.add_remote_agent(bytes(metadata))  # for an agent it knows already: adds the blocks' registrations
        data = np.empty(nbytes, dtype=np.uint8)
        registered = agent.register_memory(regions([data.ctypes.data], nbytes), "DRAM")
        try:
            into = [data.ctypes.data + i * self.block_bytes for i in range(len(hashes))]
            local, remote = (
                agent.get_xfer_descs(regions(a, self.block_bytes), "DRAM") for a in (into, reply["addresses"])
            )
            read = agent.initialize_xfer("READ", local, remote, reply["agent"])
            try:
                state = agent.transfer(read)
                while state == "PROC" and time.monotonic() < deadline:
                    state = agent.check_xfer_state(read)  # progresses UCX
            finally:
                self._release(read, data)
        finally:
            agent.deregister_memory(registered)
        if state != "DONE":
            outcome = "failed" if state == "ERR" else f"took over {self.options.timeout:g} s"
            raise RuntimeError(f"NIXL's read of {nbytes} bytes from agent {reply['agent']} {outcome}")
        send_message(sock, {"op": "done"})
        return data

    def _release(self, read: Any, data: np.ndarray) -> None:
        try:
            read.release()  # cancels a read still in flight
        except Exception:
            self._uncancelled.append(data)  # NIXL could not cancel it: it may still land there, keep it allocated
            raise

    def shutdown(self) -> None:
        super().shutdown()
        self.agent = None  # the agent closes once the side channel and the last pull let go of it


KV_CONNECTOR = KVConnector(scheduler=P2PScheduler, worker=NixlWorker)
