from fw.interfaces import comm
from fw.plugins import PluginSpec

SPEC = PluginSpec(
    name="torch",
    kind="comm",
    impl="fw_comm_torch.communicator:TorchDistributed",
    capabilities=comm.CommCapabilities(),
    api_version=comm.API_VERSION,
    description="torch.distributed collectives (gloo on CPU, NCCL on CUDA).",
)
