"""Products with dense (unquantized) weight matrices, chosen per CPU and shape by measurement.

Three operations of ``fw.sdk.kernels``, each with candidates that the first load of
a shape times (``benchmarks/RESULTS.md`` has the numbers per CPU):

``dense.linear`` (bf16 weights on the CPU):
- ``fw``: fw's AVX512-BF16 kernel (``fw/csrc/dense.cpp``) on the weight in
  pair-interleaved 16-column blocks, ``[out / 16, in / 2, 16, 2]``. On Zen 4 it
  beat oneDNN at 1-32 rows; on an AMX Xeon oneDNN beat it 2x at 32 rows.
- ``fw-amx``: AMX tiles (Sapphire Rapids and later) on the same blocks, which are
  AMX's right-hand tile layout as they stand; rows padded to 32. On an AMX Xeon at
  32 rows: the Qwen2-0.5B MLP's 9728 x 896 in 0.60 ms against oneDNN's 0.79 and
  ``fw``'s 2.9; its LM head 12.3 ms against ``fw``'s 52 (oneDNN 16, in bf16).
- ``onednn``: oneDNN's own prepacked layout (AMX where the CPU has it). A traced
  decode step cannot hold its prepacked weight (``fw.decode_graph``), so at the
  sizes steps are captured it must time 1.25x faster (``kernels.CAPTURED_ROWS``).
- ``fw-plain``: fw's kernel for CPUs without AVX512-BF16 (``plain_linear`` in
  ``fw/csrc/dense.cpp``: AVX2 + FMA, portable code elsewhere) on the plain
  weight, no second copy. Decode is memory-bound: it streams each weight row
  once, widening bf16 to float32 in registers. On a 2-core Zen 3 (AVX2), the
  weight read from memory: 14-22 GB/s at 1 row (``torch`` 15-17), 13-22 at 2
  (``torch`` 8-10), 6-10 at 8 (``torch`` 2-3).
- ``fw-gemm``: fw's blocked GEMM for prefill-sized inputs (``fw/csrc/gemm.cpp``):
  it widens 16-column panels of the plain bf16 weight to float32 as it packs
  them (no second copy) for an AVX2 6 x 16 register tile. On one Zen 3 core at
  128-256 rows: 84-88 GFLOP/s, against 62-75 for ``torch-fp32`` and 72-83 for
  oneDNN on a prepacked float32 copy.
- ``torch``: ``F.linear`` on the plain weight, the reference.
- ``torch-fp32``: the plain weight widened to float32 a chunk at a time. On a
  CPU without bf16 arithmetic (AVX2) bf16 GEMMs are 3-8x slower than float32
  ones from 8 rows up, and widening costs no memory.

``dense.logits`` (the LM head, float32 out on every path, since bf16 logits
turn near-ties into exact ties): ``fw`` and ``fw-amx`` (the same kernels storing float32),
``fw-plain`` (the same kernel storing float32, any CPU),
``torch-fp32`` (a float32 copy of the head) and ``torch`` (widened a chunk at
a time, also the path off the CPU).

``dense.argmax`` (greedy decoding's tokens, ``ModelBase.greedy_tokens``): ``logits``
(every logit, then their argmax), ``fw-int8`` (an int8 copy of the head bounds
every logit, and only the blocks the bounds leave are computed, by the logits'
own kernel: the same token) or ``fw-amx-int8`` (the same bounds from AMX-INT8
tiles). Qwen2-0.5B's head on two Zen 5 cores, one engine's steps in turns: 1
row 29.4 -> 25.5 ms a step, 32 rows 66.7 -> 60.7. On an AMX Xeon, the head
alone from memory: 1 row 11.7 -> 5.1 ms (``fw-int8``), 32 rows 19.4 (``fw-amx``
logits) -> 11.1 (``fw-amx-int8``).

float32 weights, and weights off the CPU, stay plain with ``F.linear``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from fw.sdk import kernels, native, native_ops

_SOURCE = Path(__file__).parent.parent / "csrc" / "dense.cpp"
_GEMM_SOURCE = native.INCLUDE / "gemm.cpp"
COLUMNS = 16  # output columns per block of fw's layout
AMX_DEPTH = 32  # input features per AMX tile: fw-amx needs a multiple
# Weights widened to float32 at a time, here and by quant plugins that widen theirs: 4 MiB stays in cache and
# in the allocator's pool (64 MiB chunks, mapped and faulted in afresh on every call, made widening 8x slower
# at one row on an AVX2 EPYC).
WIDEN_CHUNK = 1 << 20

LINEAR = kernels.Operation("dense.linear", reference="torch")
LOGITS = kernels.Operation("dense.logits", reference="torch")


def _cpu_bf16(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2


def _key(weight: torch.Tensor) -> tuple:
    """What a choice depends on besides the machine: (out, in, dtype)."""
    return (*weight.shape, str(weight.dtype).removeprefix("torch."))


def _bf16_key(key: tuple) -> bool:
    return key[2] == "bfloat16"


def _has_native(key: tuple) -> bool:
    return _bf16_key(key) and native.load("fw_dense", _SOURCE)


def _has_gemm(key: tuple) -> bool:
    return _bf16_key(key) and native.load("fw_gemm", _GEMM_SOURCE)


def _has_fw_tiles(key: tuple) -> bool:
    out_features, in_features, _ = key
    return out_features % COLUMNS == 0 and in_features % 2 == 0 and _has_native(key) and torch.ops.fw_dense.supported()


def _has_amx(key: tuple) -> bool:
    return key[1] % AMX_DEPTH == 0 and _has_fw_tiles(key) and torch.ops.fw_dense.amx_supported()


def _has_onednn(key: tuple) -> bool:
    return _bf16_key(key) and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _fw_tiles(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    blocks = weight.detach().contiguous().view(out_features // COLUMNS, COLUMNS, in_features // 2, 2)
    return blocks.permute(0, 2, 1, 3).contiguous()


def _flat(fn):
    """A kernel on [rows, in] as one on [..., in]."""

    def run(weight: torch.Tensor, x: torch.Tensor, *args) -> torch.Tensor:
        out = fn(weight, x.reshape(-1, x.shape[-1]), *args)
        return out.view(*x.shape[:-1], out.shape[-1])

    return run


def widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ b)`` in float32 from a weight of any float dtype, widened a chunk of rows at a time."""
    rows = max(1, WIDEN_CHUNK // weight.shape[1])
    xf = x.float()
    out = torch.cat([F.linear(xf, chunk.float()) for chunk in weight.split(rows)], dim=-1)
    return out if bias is None else out + bias.float()


LINEAR.register(kernels.Candidate(
    "fw", _flat(lambda w, x, b=None: torch.ops.fw_dense.linear(x, w, b)), _fw_tiles, "fw-tiles", _has_fw_tiles))
LINEAR.register(kernels.Candidate(
    "fw-amx", _flat(lambda w, x, b=None: torch.ops.fw_dense.amx_linear(x, w, b)), _fw_tiles, "fw-tiles", _has_amx))
LINEAR.register(kernels.Candidate(
    "onednn", lambda w, x, b=None: torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], ""),
    lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1), "onednn", _has_onednn,
    traceable=False))
LINEAR.register(kernels.Candidate(
    "fw-plain", _flat(lambda w, x, b=None: torch.ops.fw_dense.plain_linear(x, w, b)), supports=_has_native))
LINEAR.register(kernels.Candidate(
    "fw-gemm", _flat(lambda w, x, b=None: torch.ops.fw_gemm.linear(x, w, b)), supports=_has_gemm))
LINEAR.register(kernels.Candidate("torch", lambda w, x, b=None: F.linear(x, w, b)))
LINEAR.register(kernels.Candidate(
    "torch-fp32", lambda w, x, b=None: widened(x, w, b).to(x.dtype), supports=_bf16_key))

LOGITS.register(kernels.Candidate(
    "fw", _flat(lambda w, x: torch.ops.fw_dense.linear(x, w, None, True)), _fw_tiles, "fw-tiles", _has_fw_tiles))
LOGITS.register(kernels.Candidate(
    "fw-amx", _flat(lambda w, x: torch.ops.fw_dense.amx_linear(x, w, None, True)), _fw_tiles, "fw-tiles", _has_amx))
LOGITS.register(kernels.Candidate(
    "fw-plain", _flat(lambda w, x: torch.ops.fw_dense.plain_linear(x, w, None, True)), supports=_has_native))
LOGITS.register(kernels.Candidate(
    "torch-fp32", lambda w, x: F.linear(x.float(), w), lambda w: w.float(), "fp32", _bf16_key))
LOGITS.register(kernels.Candidate("torch", lambda w, x: widened(x, w)))


def _select(op: kernels.Operation, weight: torch.Tensor) -> kernels.Selection:
    in_features = weight.shape[1]
    return op.select(_key(weight), weight, lambda rows: (torch.randn(rows, in_features, dtype=weight.dtype),))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a plain weight or one ``pack_parameter`` chose a kernel for."""
    kernel = getattr(weight, "kernel", None)
    if kernel is not None:
        return kernel(x, bias)
    return F.linear(x, weight, bias)


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in float32, never rounded to the activation dtype, for a plain or ``pack_logits``-ed weight."""
    kernel = getattr(weight, "kernel", None)
    if kernel is not None:
        return kernel(x)
    if weight.dtype == torch.float32:
        return F.linear(x.float(), weight)
    return widened(x, weight)


class ArgmaxHead:
    """What ``dense.argmax``'s candidates read: the ``pack_logits``-ed head, the int8 copy ``fw-int8`` bounds the
    logits with (``fw/csrc/dense.cpp``, ``greedy_pack``), and the vocabulary (the head may have padding rows)."""

    def __init__(self, packed: torch.Tensor, tiles: torch.Tensor, int8: list[torch.Tensor], vocab: int) -> None:
        self.packed, self.tiles, self.vocab = packed, tiles, vocab
        self.q8, self.terms, self.sums = int8


def _argmax_of_logits(head: ArgmaxHead, x: torch.Tensor) -> torch.Tensor:
    return native_ops.argmax(logits(x, head.packed)[:, : head.vocab])


def _greedy(amx_bounds: bool):
    """``greedy_head`` with its int8 sums through VNNI or AMX-INT8 tiles (the same integers). The exact columns are
    added as the kernel that computes the logits for these rows adds them (``fw``'s or ``fw-amx``'s order); where
    another kernel does, their argmax is taken, so a row's token never depends on which path ran."""

    def run(head: ArgmaxHead, x: torch.Tensor) -> torch.Tensor:
        kernel = getattr(head.packed, "kernel", None)
        exact = None if kernel is None else kernel.name_for(x.shape[0])
        if exact not in ("fw", "fw-amx") or (exact == "fw-amx" and not _greedy_amx()):
            return _argmax_of_logits(head, x)
        return torch.ops.fw_dense.greedy_head(x, head.tiles, head.q8, head.terms, head.sums, head.vocab, amx_bounds,
                                              exact == "fw-amx")

    return run


def _has_greedy(key: tuple) -> bool:
    return _has_native(key) and torch.ops.fw_dense.greedy_supported()


@functools.cache
def _greedy_amx() -> bool:  # asked every greedy step: the build and the process's AMX grant do not change
    return torch.ops.fw_dense.greedy_amx_supported()


def _has_greedy_amx(key: tuple) -> bool:
    return key[1] % 64 == 0 and _has_greedy(key) and _greedy_amx()


# Each row's argmax of the LM head's logits, for greedy decoding (``ModelBase.greedy_tokens``): int64 [rows].
# - ``logits``: every logit (``logits``, the kernel chosen for them), then their argmax.
# - ``fw-int8``: an int8 copy of the head bounds every logit; the few columns whose bound reaches the best are
#   computed exactly, by the logits' own tile on its blocks: the token ``logits`` gives. Half the bytes read, four
#   multiply-adds to an int32 lane (AVX-512 VNNI).
# - ``fw-amx-int8``: the same bounds from AMX-INT8 tiles, where VNNI's multiply-adds cost more than the bytes at
#   many rows (an AMX Xeon at 32 rows).
ARGMAX = kernels.Operation("dense.argmax", reference="logits")
ARGMAX.register(kernels.Candidate("logits", _argmax_of_logits))
ARGMAX.register(kernels.Candidate("fw-int8", _greedy(False), supports=_has_greedy))
ARGMAX.register(kernels.Candidate("fw-amx-int8", _greedy(True), supports=_has_greedy_amx))


def pack_argmax(weight: torch.Tensor, packed: torch.Tensor, vocab: int) -> kernels.Selection | None:
    """The greedy argmax of the LM head ``weight`` (plain bf16 [V, K]) packed as ``packed`` (``pack_logits``),
    chosen per row class between computing every logit and ``fw-int8``; None where only the first can run here, or
    was chosen for every row class (the int8 copy is dropped then)."""
    kernel = getattr(packed, "kernel", None)
    states = [] if kernel is None else [kernel.state(name) for name in ("fw", "fw-amx")]  # one layout, "fw-tiles"
    tiles = next((state for state in states if state is not None), None)
    key = _key(weight)
    if tiles is None or weight.shape[0] % COLUMNS or weight.shape[1] % 4 or not _has_greedy(key):
        return None
    int8 = torch.ops.fw_dense.greedy_pack(weight)
    if not int8:  # weights that are not finite: no bound holds
        return None
    head = ArgmaxHead(packed, tiles, int8, vocab)
    width = weight.shape[1]
    selection = ARGMAX.select(key, head, lambda rows: (torch.randn(rows, width, dtype=weight.dtype),))
    return selection if set(selection.names) - {"logits"} else None


def _with_kernel(weight: torch.Tensor, op: kernels.Operation) -> torch.Tensor:
    """The weight in the layout its decode-sized kernel reads, carrying the selection as ``.kernel``."""
    selection = _select(op, weight)
    primary = selection.states[0]
    primary.kernel = selection
    return primary


def pack_parameter(module: torch.nn.Module, name: str = "weight") -> None:
    """Choose ``module.<name>``'s kernel and swap the weight for the layout it reads, in place (a buffer:
    packed tensors are no parameters). Where row classes chose a second layout, it is kept as ``<name>_1``."""
    weight = getattr(module, name)
    if not _cpu_bf16(weight):
        return
    packed = _with_kernel(weight, LINEAR)
    if packed is not weight:
        delattr(module, name)
        module.register_buffer(name, packed, persistent=False)
    for i, extra in enumerate(packed.kernel.states[1:], 1):
        module.register_buffer(f"{name}_{i}", extra, persistent=False)


def pack_logits(weight: torch.Tensor) -> torch.Tensor:
    """The LM head's weight for ``logits``, with its kernel chosen (unchanged off the CPU or in float32)."""
    return _with_kernel(weight, LOGITS) if _cpu_bf16(weight) else weight
