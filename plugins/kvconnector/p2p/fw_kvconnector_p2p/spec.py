"""P2P KV connector spec. Imports only fw.interfaces, fw.sdk.side_channel_options and pydantic: listing plugins must not load torch."""

from typing import Literal

from pydantic import Field

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec
from fw.sdk.side_channel_options import SideChannelOptions


class P2POptions(SideChannelOptions):
    transport: Literal["auto", "shm", "tcp"] = Field(
        "auto", description="auto: shared memory when the peer is on this host, TCP otherwise."
    )


SPEC = PluginSpec(
    name="p2p",
    kind="kv_connector",
    impl="fw_kvconnector_p2p.connector:KV_CONNECTOR",
    capabilities=kvconnector.KVConnectorCapabilities(devices=frozen("cpu", "cuda"), roles=frozen("producer", "consumer", "both")),
    api_version=1,
    description=(
        "Disaggregated prefill/decode: a producer keeps the KV of the prompts it computed; a consumer asks it over a "
        "side channel which prefix it holds and pulls those blocks, over shared memory on one host, TCP otherwise."
    ),
    options=P2POptions,
)
