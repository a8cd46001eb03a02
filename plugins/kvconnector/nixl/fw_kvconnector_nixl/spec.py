"""NIXL KV connector spec. Imports only fw.plugins / fw.interfaces, pydantic and p2p's spec: listing plugins must
not load torch or nixl."""

from pydantic import Field

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec
from fw.sdk.side_channel_options import SideChannelOptions


class NixlOptions(SideChannelOptions):
    backend: str = Field("UCX", description="The NIXL backend that moves the blocks (only UCX is tested).")


SPEC = PluginSpec(
    name="nixl",
    kind="kv_connector",
    impl="fw_kvconnector_nixl.connector:KV_CONNECTOR",
    capabilities=kvconnector.KVConnectorCapabilities(
        devices=frozen("cpu", "cuda"), roles=frozen("producer", "consumer", "both"), requires_modules=("nixl",)
    ),
    api_version=1,
    description=(
        "Disaggregated prefill/decode as p2p does (a side channel for lookups and the handshake), the blocks read "
        "by NVIDIA's NIXL (UCX: shared memory on one host, TCP or RDMA across hosts)."
    ),
    options=NixlOptions,
)
