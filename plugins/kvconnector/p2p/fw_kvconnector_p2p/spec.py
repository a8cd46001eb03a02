"""P2P KV connector spec. Imports only fw.plugins / fw.interfaces and pydantic: listing plugins must not load torch."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec


class SideChannelOptions(BaseModel):
    """The options of every connector built on p2p's side channel (this one and fw-kvconnector-mooncake)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["producer", "consumer", "both"] = Field(
        "both", description="producer serves its prompt KV, consumer loads a producer's, both does both."
    )
    host: str = Field("127.0.0.1", description="Address the producer's side channel listens on.")
    port: int = Field(0, ge=0, lt=65536, description="Port of the producer's side channel (0: any free port).")
    peer: str | None = Field(None, description="HOST:PORT of the producer's side channel (consumer and both).")
    buffer_mb: int = Field(1024, gt=0, description="Producer: MiB of prompt KV kept for consumers, least recent dropped first.")
    timeout: float = Field(10.0, gt=0, description="Seconds a lookup or a load may take; past it, the tokens are computed.")

    @model_validator(mode="after")
    def _peer_for_consumers(self) -> "SideChannelOptions":
        if self.role == "consumer" and self.peer is None:
            raise ValueError("role consumer needs peer=HOST:PORT (the producer's side channel)")
        if self.peer is not None:
            host, sep, port = self.peer.rpartition(":")
            if not (host and sep and port.isdigit()):
                raise ValueError(f"peer: expected HOST:PORT, got {self.peer!r}")
        return self


class P2POptions(SideChannelOptions):
    transport: Literal["auto", "shm", "tcp"] = Field(
        "auto", description="auto: shared memory when the peer is on this host, TCP otherwise."
    )


SPEC = PluginSpec(
    name="p2p",
    kind="kv_connector",
    impl="fw_kvconnector_p2p.connector:KV_CONNECTOR",
    capabilities=kvconnector.KVConnectorCapabilities(devices=frozen("cpu", "cuda"), roles=frozen("producer", "consumer", "both")),
    api_version=kvconnector.API_VERSION,
    description=(
        "Disaggregated prefill/decode: a producer keeps the KV of the prompts it computed; a consumer asks it over a "
        "side channel which prefix it holds and pulls those blocks, over shared memory on one host, TCP otherwise."
    ),
    options=P2POptions,
)
