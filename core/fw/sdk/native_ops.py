"""The bf16 and float32 CPU kernels of the decoder's elementwise layers (``fw/csrc/layers.cpp``).

RMSNorm (with its residual add), neox rotary and SiLU-and-multiply take three
to eight passes over memory each as torch ops, and at prefill sizes they
cost a third as much as the matrix products; at decode sizes their dozens of
small ops a layer cost more than the arithmetic (a float32 GGUF model's decode
step ran about 1,100 of them). The kernels do one pass each and round to bf16
wherever the torch path rounds, so both paths agree. Other dtypes and
devices, or a machine without a compiler, keep the torch path. Greedy
sampling's argmax over the vocabulary is here too.
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


def logit_rows(logits: torch.Tensor) -> bool:
    """Whether the native sampling kernels take ``logits``: float32 ``[rows, vocab]`` on the CPU, built."""
    return logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1] > 0 and usable(logits)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 ``[rows, vocab]`` logits, the same indices (the first of equal values);
    in one native pass on the CPU, where torch's argmax cost 0.4 ms a row over a 152k vocabulary. A row with a NaN
    takes torch's answer."""
    if not logit_rows(logits):
        return logits.argmax(dim=-1)
    tokens = torch.ops.fw_layers.argmax_rows(logits)
    nan = tokens < 0
    return torch.where(nan, logits.argmax(dim=-1), tokens) if bool(nan.any()) else tokens


def evict(tensors: list[torch.Tensor]) -> None:
    """Drops the CPU tensors' bytes from every cache level (kernel choice times weights as a step meets them: in
    memory); nothing where the native kernels are not built."""
    if tensors and _built():
        torch.ops.fw_layers.evict(tensors)
