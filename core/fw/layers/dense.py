"""Products with dense (unquantized) weight matrices, and the layouts that make them fast on the CPU.

``pack`` reorders a weight once, after loading; ``linear`` multiplies by any
form. Measured on two AVX-512 cores with the 24 layers + LM head of a
Qwen2-0.5B-shaped model in bf16 (``benchmarks/RESULTS.md``):

- fw's own kernel (``fw/csrc/dense.cpp``, AVX512-BF16): the weight in
  pair-interleaved 16-column blocks, ``[out / 16, in / 2, 16, 2]``. One row:
  30 GB/s of weights (oneDNN 24, plain ``F.linear`` 17); 32 rows: 367 GFLOP/s
  (oneDNN 338, ``F.linear`` 250); 256 rows: on par with oneDNN (~400).
- otherwise oneDNN's own blocked layout, where torch has oneDNN with bf16;
- otherwise the plain ``[out, in]`` matrix and ``F.linear``.

float32 always stays plain: it is the reference path tests compare against.

The LM head is the exception to "output in the activation dtype": ``logits``
returns float32 on every path (see ``pack_logits``), since bf16 logits turn
near-ties into exact ties.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from fw import native

_SOURCE = Path(__file__).parent.parent / "csrc" / "dense.cpp"
COLUMNS = 16  # output columns per block of fw's layout


def _cpu_bf16(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2


def _native(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return (
        out_features % COLUMNS == 0
        and in_features % 2 == 0
        and native.load("fw_dense", _SOURCE)
        and torch.ops.fw_dense.supported()
    )


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(weight: torch.Tensor) -> bool:
    return _cpu_bf16(weight) and (_native(weight) or _onednn())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in the fastest layout this machine has for it (unchanged if none pays)."""
    if not can_pack(weight):
        return weight
    weight = weight.detach().contiguous()
    if _native(weight):
        out_features, in_features = weight.shape
        blocks = weight.view(out_features // COLUMNS, COLUMNS, in_features // 2, 2)
        return blocks.permute(0, 2, 1, 3).contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a plain or ``pack``-ed weight."""
    if weight.dim() == 4:  # fw's layout
        flat = torch.ops.fw_dense.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return flat.view(*x.shape[:-1], flat.shape[-1])
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_logits(weight: torch.Tensor) -> torch.Tensor:
    """The LM head's weight for ``logits``: fw's layout where its kernel runs, plain bf16 for fw's portable
    kernel, else a float32 copy (oneDNN's layouts and ``F.linear`` have no float32 output for bf16 inputs)."""
    if not _cpu_bf16(weight):
        return weight
    if _native(weight):
        return pack(weight)
    return weight if native.load("fw_dense", _SOURCE) else weight.float()


# Rows of a weight widened to float32 at a time off the CPU: bounds the temporary (64 MiB).
_LOGIT_CHUNK_WEIGHTS = 1 << 24


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in float32, never rounded to the activation dtype, for a ``pack_logits``-ed weight."""
    flat = x.reshape(-1, x.shape[-1])
    if weight.dim() == 4:
        out = torch.ops.fw_dense.linear(flat, weight, None, True)
    elif weight.dtype == torch.float32:
        out = F.linear(flat.float(), weight)
    elif _cpu_bf16(weight):
        out = torch.ops.fw_dense.logits(flat, weight)
    else:
        rows = max(1, _LOGIT_CHUNK_WEIGHTS // weight.shape[1])
        out = torch.cat([F.linear(flat.float(), chunk.float()) for chunk in weight.split(rows)], dim=-1)
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_parameter(module: torch.nn.Module, name: str = "weight") -> None:
    """Swap ``module.<name>`` for its packed form, in place (a buffer: packed tensors are no parameters)."""
    weight = getattr(module, name)
    if can_pack(weight):
        delattr(module, name)
        module.register_buffer(name, pack(weight), persistent=False)
