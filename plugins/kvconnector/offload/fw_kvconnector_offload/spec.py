"""Tiered offload KV connector spec.

Imports only fw.plugins / fw.interfaces (and pydantic for the options): listing plugins must not load torch.
"""

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec


class OffloadOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        "/tmp/fw-kv-offload",
        description="Directory of the disk tier, this engine's alone: block files an earlier run left there are removed.",
    )
    # ByteSize: a number of bytes or a size with its unit ("4GiB").
    cpu_bytes: ByteSize = Field(
        ByteSize(1 << 30),
        ge=0,
        description="Bytes of host memory for the RAM tier; its least recently used blocks spill to disk.",
    )
    disk_bytes: ByteSize = Field(
        ByteSize(16 << 30),
        ge=0,
        description="Bytes of block files in the disk tier; its least recently used files are deleted.",
    )

    timeout: float = Field(
        30.0, gt=0, description="Seconds a load from disk may take; past it, the request computes its tokens."
    )

    @model_validator(mode="after")
    def _some_tier(self) -> "OffloadOptions":
        if self.cpu_bytes == 0 and self.disk_bytes == 0:
            raise ValueError("cpu_bytes and disk_bytes are both 0: no tier to offload to")
        return self


SPEC = PluginSpec(
    name="offload",
    kind="kv_connector",
    impl="fw_kvconnector_offload.connector:KV_CONNECTOR",
    # It saves into and loads from its own store: always both roles at once.
    capabilities=kvconnector.KVConnectorCapabilities(devices=frozen("cpu", "cuda"), roles=frozen("both")),
    api_version=1,
    description=(
        "Keeps the KV of every full prompt block in a bounded CPU-RAM tier that spills to a bounded disk tier "
        "(least recently used first, checksummed files), and loads prefixes found there instead of computing them."
    ),
    options=OffloadOptions,
)
