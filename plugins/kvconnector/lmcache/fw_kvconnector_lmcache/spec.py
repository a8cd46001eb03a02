"""LMCache KV connector spec.

Imports only fw.plugins / fw.interfaces and pydantic: listing plugins must load neither torch nor lmcache.
"""

from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec


class LMCacheOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: str = Field(
        "cpu",
        description=(
            "cpu: LMCache's RAM backend; disk: its local-disk backend under path (both this process's own, shared by "
            "its engines); lm://HOST:PORT: an LMCache server, shared by every instance that names it."
        ),
    )
    role: Literal["producer", "consumer", "both"] = Field(
        "both", description="producer saves prompt blocks, consumer loads them, both does both."
    )
    path: str = Field("/tmp/fw-kv-lmcache", description="disk: the directory of LMCache's block files.")
    # ByteSize: a number of bytes or a size with its unit ("4GiB").
    cpu_bytes: ByteSize = Field(
        ByteSize(1 << 30),
        gt=0,
        description="cpu: the store's size, least recently used blocks evicted; disk and lm://: the buffer blocks pass through.",
    )
    disk_bytes: ByteSize = Field(
        ByteSize(16 << 30), gt=0, description="disk: bytes of block files, least recently used deleted."
    )
    namespace: str = Field(
        "",
        pattern=r"^[A-Za-z0-9_.-]{0,32}$",
        description=(
            "Blocks are keyed by their tokens and the cache's layout only: models of one layout sharing a store "
            "need a namespace each."
        ),
    )
    timeout: int = Field(10, gt=0, description="Seconds a load from the lm:// server, or a step's saves, may take.")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, backend: str) -> str:
        if backend in ("cpu", "disk"):
            return backend
        host, sep, port = backend.removeprefix("lm://").rpartition(":")
        if not (backend.startswith("lm://") and host and sep and port.isdigit()):
            raise ValueError(f"expected cpu, disk or lm://HOST:PORT, got {backend!r}")
        return backend


SPEC = PluginSpec(
    name="lmcache",
    kind="kv_connector",
    impl="fw_kvconnector_lmcache.connector:KV_CONNECTOR",
    # Checked on CPU only: on a CUDA host LMCache stages through pinned memory and CUDA streams of its own.
    capabilities=kvconnector.KVConnectorCapabilities(
        devices=frozen("cpu"), roles=frozen("producer", "consumer", "both"), requires_modules=("lmcache",)
    ),
    api_version=1,
    description=(
        "Saves the KV of every prompt block, keyed by its prefix hash, into LMCache's storage (CPU RAM, local disk, "
        "or an lm:// server that instances share), and loads matching prefixes instead of computing them."
    ),
    options=LMCacheOptions,
)
