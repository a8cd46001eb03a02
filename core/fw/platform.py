"""What device this process runs on, detected once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    device: str  # "cpu" or "cuda"
    compute_capability: tuple[int, int] | None = None
    count: int = 1


def detect(requested: str = "auto") -> DeviceInfo:
    """Resolve "auto" to CUDA when a GPU is visible, else CPU; "cuda" without a GPU is kept (and rejected by checks)."""
    if requested == "cpu":
        return DeviceInfo("cpu")
    import torch

    if torch.cuda.is_available():
        return DeviceInfo("cuda", torch.cuda.get_device_capability(0), torch.cuda.device_count())
    return DeviceInfo("cuda", None, 0) if requested == "cuda" else DeviceInfo("cpu")
