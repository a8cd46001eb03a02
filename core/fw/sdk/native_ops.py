"""The bf16 and float32 CPU kernels of the decoder's elementwise layers (``fw/csrc/layers.cpp``).

RMSNorm (with its residual add), neox rotary and SiLU-and-multiply take three
to eight passes over memory each as torch ops, and at prefill sizes they
cost a third as much as the matrix products; at decode sizes their dozens of
small ops a layer cost more than the arithmetic (a float32 GGUF model's decode
step ran about 1,100 of them). The kernels do one pass each and round to bf16
wherever the torch path rounds, so both paths agree. Other dtypes and
devices, or a machine without a compiler, keep the torch path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fw.sdk import native

_SOURCE = Path(__file__).parent.parent / "csrc" / "layers.cpp"
_DTYPES = (torch.bfloat16, torch.float32)


_ready = False  # once True for good; False is asked again (a build in the background may land, native.poll)


def _built() -> bool:  # asked a few hundred times a decode step: a global is the cheapest answer
    global _ready
    _ready = _ready or native.load("fw_layers", _SOURCE)
    return _ready


def usable(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and x.device.type == "cpu" and _built()
