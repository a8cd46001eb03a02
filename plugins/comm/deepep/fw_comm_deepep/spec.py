"""DeepEP expert-parallel all-to-all for CUDA GPUs.

Imports only fw.plugins / fw.interfaces (and pydantic for the options): listing plugins must not load torch or
deep_ep.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fw.interfaces import comm
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec


class DeepEPOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "normal", "low_latency"] = Field(
        "auto",
        description="normal: the high-throughput kernels (prefill); low_latency: the RDMA kernels for small batches "
        "(decode); auto: low_latency when every rank dispatches at most max_low_latency_tokens tokens, else normal.",
    )
    max_low_latency_tokens: int = Field(
        128, gt=0, description="Most tokens one rank dispatches with the low-latency kernels (sizes their buffer)."
    )


SPEC = PluginSpec(
    name="deepep",
    kind="comm",
    impl="fw_comm_deepep.communicator:DeepEPCommunicator",
    capabilities=comm.CommCapabilities(
        devices=frozen("cuda"),
        min_compute_capability=(9, 0),  # DeepEP's kernels target SM90 (Hopper)
        min_devices=2,
        dtypes=frozen("bfloat16"),  # the kernels move bfloat16 tokens
        requires_modules=("deep_ep",),
    ),
    api_version=2,
    description=(
        "MoE dispatch/combine with DeepEP (normal kernels for prefill, low-latency kernels for decode) and NCCL "
        "for the other collectives; needs CUDA GPUs of compute capability >= 9.0, at least 2 of them, bfloat16 "
        "and deep_ep built from source (plugins/comm/deepep/README.md). Not verified on any machine available "
        "to the project."
    ),
    options=DeepEPOptions,
)
