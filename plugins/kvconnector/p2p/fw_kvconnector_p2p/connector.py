"""P2P KV connector: prompt KV from a prefill instance (producer) to a decode instance (consumer), over the side
channel (``fw.sdk.side_channel``, which says how it works); the blocks' bytes move over shared memory (a file in
/dev/shm that the consumer creates and the producer writes) when both run on one host, over the socket otherwise.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from typing import Any

from fw.interfaces.kvconnector import KVConnector
from fw.sdk.side_channel import (
    SHM_DIR,
    SHM_PREFIX,
    P2PScheduler,
    SideChannelWorker,
    host_id,
    recv_message,
    send_message,
    sweep_shm,
)
from fw_kvconnector_p2p.spec import P2POptions

log = logging.getLogger("fw")


class P2PWorker(SideChannelWorker):
    name = "p2p"

    def __init__(self, options: P2POptions | None) -> None:
        super().__init__(options or P2POptions())
        self._shm = self.options.transport != "tcp"  # "auto" drops it for good once the producer cannot use it
        if self._shm:
            sweep_shm()

    def _fetch(self, sock: socket.socket, hello: dict[str, Any], hashes: list[int], nbytes: int) -> bytearray:
        same_host = hello["host"] == host_id() and SHM_DIR.is_dir()
        if self._shm and (same_host or self.options.transport == "shm"):
            data = self._pull_shm(sock, hashes, nbytes)
            if data is not None:
                return data
        send_message(sock, {"op": "get", "hashes": hashes})
        reply, data = recv_message(sock)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return data

    def _pull_shm(self, sock: socket.socket, hashes: list[int], nbytes: int) -> bytearray | None:
        """Through a /dev/shm file the producer writes; None when it cannot (then TCP, unless shm was asked for)."""
        fd, path = tempfile.mkstemp(dir=SHM_DIR, prefix=f"{SHM_PREFIX}{os.getpid()}-")
        try:
            os.ftruncate(fd, nbytes)
            send_message(sock, {"op": "get", "hashes": hashes, "shm": os.path.basename(path)})
            reply, _ = recv_message(sock)
            if "error" not in reply:
                data = bytearray(nbytes)
                with os.fdopen(os.dup(fd), "rb") as f:
                    if f.readinto(data) != nbytes:
                        raise RuntimeError("the shared-memory file is shorter than the blocks")
                return data
            if not reply["error"].startswith("shm:") or self.options.transport == "shm":
                raise RuntimeError(reply["error"])
            log.info("KV connector p2p: the producer cannot use shared memory (%s); using TCP", reply["error"])
            self._shm = False
            return None
        finally:
            os.close(fd)
            os.unlink(path)


KV_CONNECTOR = KVConnector(scheduler=P2PScheduler, worker=P2PWorker)
