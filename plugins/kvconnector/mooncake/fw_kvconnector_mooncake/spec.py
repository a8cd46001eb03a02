"""Mooncake KV connector spec. Imports only fw.plugins / fw.interfaces, pydantic and p2p's spec: listing
plugins must not load torch or mooncake."""

from typing import Literal

from pydantic import Field, model_validator

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec
from fw.sdk.side_channel_options import SideChannelOptions

# Options that only one mode reads: setting one in the other mode is a mistake, refused.
TRANSFER_ONLY = ("peer", "port", "buffer_mb")
STORE_ONLY = ("master", "metadata_server", "segment_mb", "namespace")


class MooncakeOptions(SideChannelOptions):
    mode: Literal["transfer", "store"] = Field(
        "transfer",
        description="transfer: a consumer pulls a producer's blocks point to point; store: every instance saves its "
        "prompt blocks into a Mooncake Store pool (mooncake_master) and loads the prefixes it finds there.",
    )
    host: str = Field(
        "127.0.0.1",
        description="This instance's address: peers reach its Transfer Engine there (transfer: and the producer's side "
        "channel; store: its share of the pool).",
    )
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="The Transfer Engine's transport (rdma needs RDMA NICs)."
    )
    device_name: str = Field("", description="rdma: the NICs to use, comma-separated (empty: Mooncake picks).")
    master: str | None = Field(
        None,
        pattern=r"^[^:\s]+:\d{1,5}$",
        description="store: HOST:PORT of mooncake_master's RPC service (its --rpc_port).",
    )
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        min_length=1,
        description="store: where Mooncake clients find each other's memory: P2PHANDSHAKE (no server, they ask each "
        "other), or a metadata server's address (http://HOST:PORT/metadata, etcd HOST:PORT).",
    )
    segment_mb: int = Field(
        1024,
        ge=0,
        description="store: MiB of host memory this instance adds to the pool (0: none, it only uses the others').",
    )
    namespace: str = Field(
        "fw-kv",
        pattern=r"^[A-Za-z0-9._-]+$",
        description="store: prefix of the keys; blocks are keyed by their tokens only, so use one namespace per model.",
    )

    @model_validator(mode="after")
    def _peer_for_consumers(self) -> "MooncakeOptions":
        # Replaces p2p's check of the same name: in store mode nothing needs a peer, a master instead.
        misplaced = sorted(self.model_fields_set & set(STORE_ONLY if self.mode == "transfer" else TRANSFER_ONLY))
        if misplaced:
            raise ValueError(f"{', '.join(misplaced)}: not an option of mode {self.mode}")
        if self.mode == "transfer":
            return super()._peer_for_consumers()
        if self.master is None:
            raise ValueError("mode store needs master=HOST:PORT (mooncake_master's RPC address)")
        return self


SPEC = PluginSpec(
    name="mooncake",
    kind="kv_connector",
    impl="fw_kvconnector_mooncake.connector:KV_CONNECTOR",
    capabilities=kvconnector.KVConnectorCapabilities(
        devices=frozen("cpu", "cuda"), roles=frozen("producer", "consumer", "both"), requires_modules=("mooncake",)
    ),
    api_version=1,
    description=(
        "Disaggregated prefill/decode over Mooncake (TCP or RDMA): blocks pulled point to point from a producer "
        "(mode transfer, the side channel (fw.sdk.side_channel)), or saved into and loaded from a Mooncake Store pool (mode store)."
    ),
    options=MooncakeOptions,
)
