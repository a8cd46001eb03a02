"""The options of side-channel connectors: light (pydantic only), as their specs read them when plugins are listed."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SideChannelOptions(BaseModel):
    """The options of every connector built on the side channel (``fw.sdk.side_channel``): p2p, mooncake, nixl."""

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
