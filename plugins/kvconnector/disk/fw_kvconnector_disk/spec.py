"""Disk KV connector: prompt-prefix KV blocks shared through a directory (a local disk or shared storage).

Imports only fw.plugins / fw.interfaces (and pydantic for the options): listing plugins must not load torch.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fw.interfaces import kvconnector
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec


class DiskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        "/tmp/fw-kv",
        description="Directory of KV block files. Blocks are keyed by their tokens only: use one directory per model.",
    )
    role: Literal["producer", "consumer", "both"] = Field(
        "both", description="producer saves full prompt blocks, consumer loads them, both does both."
    )


SPEC = PluginSpec(
    name="disk",
    kind="kv_connector",
    impl="fw_kvconnector_disk.connector:KV_CONNECTOR",
    capabilities=kvconnector.KVConnectorCapabilities(
        devices=frozen("cpu", "cuda"),
        roles=frozen("producer", "consumer", "both"),
    ),
    api_version=1,
    description=(
        "Saves the KV of every full prompt block to a directory, keyed by its prefix hash, and loads "
        "matching prefixes instead of computing them (across instances or restarts)."
    ),
    options=DiskOptions,
)
