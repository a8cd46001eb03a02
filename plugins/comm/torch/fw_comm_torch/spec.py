from fw.interfaces import comm
from fw.interfaces.spec import PluginSpec

SPEC = PluginSpec(
    name="torch",
    kind="comm",
    impl="fw.sdk.torch_distributed:TorchDistributed",
    capabilities=comm.CommCapabilities(),
    api_version=2,
    description="torch.distributed collectives (gloo on CPU, NCCL on CUDA).",
)
