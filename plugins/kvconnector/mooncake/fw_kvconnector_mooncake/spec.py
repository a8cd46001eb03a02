"""Mooncake KV connector spec. Imports only fw.plugins / fw.interfaces, pydantic and p2p's spec: listing
plugins must not load torch or mooncake."""

from typing import Literal

from pydantic import Field

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.plugins import PluginSpec
from fw_kvconnector_p2p.spec import SideChannelOptions


class MooncakeOptions(SideChannelOptions):
    host: str = Field(
        "127.0.0.1",
        description="This instance's address: the producer's side channel listens on it, and peers reach its Transfer Engine there.",
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="The Transfer Engine's transport (rdma needs RDMA NICs).")
    device_name: str = Field("", description="rdma: the NICs to use, comma-separated (empty: Mooncake picks).")


SPEC = PluginSpec(
    name="mooncake",
    kind="kv_connector",
    impl="fw_kvconnector_mooncake.connector:KV_CONNECTOR",
    capabilities=kvconnector.KVConnectorCapabilities(
        devices=frozen("cpu", "cuda"), roles=frozen("producer", "consumer", "both"), requires_modules=("mooncake",)
    ),
    api_version=kvconnector.API_VERSION,
    description=(
        "Disaggregated prefill/decode as p2p does (a side channel for lookups and the handshake), the blocks moved "
        "by Mooncake's Transfer Engine (TCP or RDMA)."
    ),
    options=MooncakeOptions,
)
