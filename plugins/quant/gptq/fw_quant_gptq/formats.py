"""The integer checkpoint layouts, read from ``quantization_config`` into a ``Scheme`` per layer and decoded
to ``(q, zero, scale, g_idx)``, which ``packed.repack`` turns into fw's layout.

- GPTQ v1 (AutoGPTQ, GPTQModel, optimum; ``quant_method: gptq``): ``qweight`` int32 ``[K / f, N]`` with ``f =
  32 / bits`` input features per word, feature ``i`` of a word at bit ``bits * i``; ``qzeros`` int32 ``[groups,
  N / f]`` packed the same way along the outputs, each word minus 0x11111111 (8-bit: 0x01010101), i.e. every
  zero minus one (``checkpoint_format: gptq_v2``: as is); ``scales`` ``[groups, N]``; ``g_idx`` ``[K]``, the group of each input feature (permuted under
  act-order, ``desc_act``). ``sym`` stores the zero 2^(bits-1).
- AWQ GEMM (AutoAWQ, ``quant_method: awq``, 4-bit): ``qweight`` int32 ``[K, N / 8]``, output ``8c + j`` of a
  word at nibble ``AWQ_NIBBLE[j]``; ``qzeros`` ``[K / group, N / 8]`` likewise, zeros as they are;
  ``scales`` ``[K / group, N]``.
- compressed-tensors ``pack-quantized`` (llm-compressor W4A16 / W8A16): ``weight_packed`` int32 ``[N, K / f]``,
  feature ``i`` of a word at bit ``bits * i``, each the signed integer plus 2^(bits-1); ``weight_scale`` ``[N,
  groups]``; asymmetric schemes add ``weight_zero_point`` packed along the outputs ``[N / f, groups]``;
  ``weight_shape``; act-order adds ``weight_g_idx``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fw.interfaces.quant import MOE_ROUTERS, ModuleSchemes
from fw.sdk.errors import ModelLoadError

# AWQ's interleaved nibble order: output 8c + j of a packed word sits at nibble AWQ_NIBBLE[j].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)

Layout = Literal["gptq", "gptq_v2", "awq", "pack-quantized"]


@dataclass(frozen=True)
class Scheme:
    """One layer's format."""

    layout: Layout
    bits: int
    group: int  # input features per scale; -1: one scale per output row
    symmetric: bool = True
    act_order: bool = False  # the checkpoint stores a g_idx (GPTQ always does)

    def groups(self, in_features: int) -> int:
        return 1 if self.group == -1 else -(-in_features // self.group)


def _bits(value: Any, allowed: tuple[int, ...], what: str) -> int:
    if value not in allowed:
        raise ModelLoadError(f"{what}: {value!r} bits are not supported (supported: {', '.join(map(str, allowed))})")
    return value


class Schemes(ModuleSchemes[Scheme]):
    """Checkpoint module name -> its ``Scheme``, or None for a layer the checkpoint leaves in float.

    MoE routers are never quantized by these tools; the LM head and embeddings are no linear layers here.
    """

    def __init__(self, quant_config: dict[str, Any]) -> None:
        super().__init__()
        method = quant_config.get("quant_method")
        self.ignore = [MOE_ROUTERS]
        self.overrides: list[tuple[str, Scheme]] = []  # GPTQModel's per-module "dynamic" settings, by regex
        if method == "gptq":
            for pattern, settings in (quant_config.get("dynamic") or {}).items():
                if pattern.startswith("-:"):
                    self.ignore.append("re:" + pattern[2:])
                else:
                    self.overrides.append((pattern.removeprefix("+:"), _gptq({**quant_config, **settings})))
            self.groups = [(["Linear"], _gptq(quant_config))]
        elif method == "awq":
            self.groups = [(["Linear"], _awq(quant_config))]
            self.ignore += list(quant_config.get("modules_to_not_convert") or [])
        elif method == "compressed-tensors":
            self.groups = [(g.get("targets") or ["Linear"], _compressed_tensors(name, g))
                           for name, g in quant_config["config_groups"].items()]
            self.ignore += list(quant_config.get("ignore") or [])
        else:
            raise ModelLoadError(f"quant_method {method!r} is not an integer weight format this plugin loads")

    def __call__(self, name: str) -> Scheme | None:
        scheme = super().__call__(name)
        for pattern, override in self.overrides:
            if scheme is not None and re.match(pattern, name):
                return override
        return scheme


def _gptq(config: dict[str, Any]) -> Scheme:
    if config.get("lm_head"):
        raise ModelLoadError("gptq quantization_config.lm_head true (a quantized LM head) is not supported; "
                             "quantize with lm_head false")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2 are; "
                             "Marlin- or BitBLAS-repacked checkpoints are not)")
    bits = _bits(config.get("bits"), (4, 8), "gptq quantization_config.bits")
    group = config.get("group_size", 128)
    if group != -1 and (not isinstance(group, int) or group <= 0):
        raise ModelLoadError(f"gptq quantization_config.group_size {group!r} is not a positive integer or -1")
    return Scheme(fmt, bits, group, bool(config.get("sym", True)), bool(config.get("desc_act", False)))


def _awq(config: dict[str, Any]) -> Scheme:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"awq quantization_config.version {config.get('version')!r} is not supported "
                             "(gemm is; gemv, exllama, marlin and ipex repack the weights otherwise)")
    if not config.get("zero_point", True):
        raise ModelLoadError("awq quantization_config.zero_point false is not supported: the tools that write it "
                             "disagree on what it stores; quantize with zero_point true")
    bits = _bits(config.get("bits", config.get("w_bit")), (4,), "awq quantization_config.bits")
    group = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group, int) or group <= 0:
        raise ModelLoadError(f"awq quantization_config.group_size {group!r} is not supported (a positive group)")
    return Scheme("awq", bits, group, symmetric=False)


def _compressed_tensors(name: str, group: dict[str, Any]) -> Scheme:
    weights = group.get("weights") or {}
    what = f"compressed-tensors config_groups.{name}.weights"
    if weights.get("type") != "int":
        raise ModelLoadError(f"{what}.type {weights.get('type')!r}: this plugin loads int weights")
    if group.get("input_activations"):
        raise ModelLoadError(f"compressed-tensors config_groups.{name}.input_activations: activation quantization "
                             "(W8A8 int) is not supported; this plugin loads weight-only W4A16 / W8A16")
    bits = _bits(weights.get("num_bits"), (4, 8), f"{what}.num_bits")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise ModelLoadError(f"{what}.strategy {strategy!r} is not supported (group, channel are)")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "group", "weight", "static", "dynamic"):
        raise ModelLoadError(f"{what}.actorder {actorder!r} is not supported")
    # "group" (older "dynamic") stores weight_g_idx; "weight" (older "static") keeps the groups in order.
    return Scheme("pack-quantized", bits, weights.get("group_size") if strategy == "group" else -1,
                  bool(weights.get("symmetric", True)), actorder in ("group", "dynamic"))


# ----- decoding

def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``words`` packed along ``dim`` (``32 / bits`` fields each, field ``j`` at bit ``bits * j``, or at
    ``bits * order[j]``) as uint8 values, that dimension grown by ``32 / bits``."""
    per = 32 // bits
    slots = torch.tensor(order if order is not None else range(per), dtype=torch.int32, device=words.device)
    shape = [1] * (words.dim() + 1)
    shape[dim + 1] = per
    fields = (words.unsqueeze(dim + 1) >> (bits * slots).view(shape)) & ((1 << bits) - 1)
    return fields.flatten(dim, dim + 1).to(torch.uint8)


# GPTQ v1 stores zero points minus one as one subtraction from each packed word (GPTQModel writes and reads them
# so; a field holding zero then borrows from the next one, which the addition undoes).
V1_ONES = {4: 0x11111111, 8: 0x01010101}


def shift_words(words: torch.Tensor, delta: int) -> torch.Tensor:
    """int32 words plus ``delta``, modulo 2^32."""
    wide = (words.long() + delta) & 0xFFFFFFFF
    return torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)


def pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``unpack``: values in [0, 2^bits) as int32 words along ``dim``."""
    per = 32 // bits
    slots = torch.tensor(order if order is not None else range(per), dtype=torch.int64)
    shape = [1] * (values.dim() + 1)
    shape[dim + 1] = per
    grouped = values.long().unflatten(dim, (-1, per))
    return shift_words((grouped << (bits * slots).view(shape)).sum(dim + 1), 0)


def in_features(scheme: Scheme, t: dict[str, torch.Tensor]) -> int:
    """A matrix's input features, from its packed weight's shape."""
    if scheme.layout in ("gptq", "gptq_v2"):
        return t["qweight"].shape[0] * 32 // scheme.bits
    if scheme.layout == "awq":
        return t["qweight"].shape[0]
    return t["weight_packed"].shape[1] * 32 // scheme.bits


def decode(scheme: Scheme, t: dict[str, torch.Tensor], in_features: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (stacked) layer's checkpoint tensors as ``q`` uint8 [N, K], ``zero`` and ``scale`` float32 [N, groups]:
    the weight is ``scale * (q - zero)`` per group. The g_idx is the caller's (one per fused sub-matrix)."""
    bits, layout = scheme.bits, scheme.layout
    top = float(1 << (bits - 1))
    if layout in ("gptq", "gptq_v2"):
        q = unpack(t["qweight"], bits, 0).T
        words = t["qzeros"]
        if layout == "gptq":  # v1: each word holds its zeros minus one in every field, borrows included
            words = shift_words(words, V1_ONES[bits])
        return q[:, :in_features], unpack(words, bits, 1).T.float(), t["scales"].float().T
    if layout == "awq":
        q = unpack(t["qweight"], bits, 1, AWQ_NIBBLE).T
        zero = unpack(t["qzeros"], bits, 1, AWQ_NIBBLE).T
        return q, zero.float(), t["scales"].float().T
    q = unpack(t["weight_packed"], bits, 1)[:, :in_features]
    scale = t["weight_scale"].float()
    if scheme.symmetric:
        zero = torch.full_like(scale, top)
    else:
        zero = unpack(t["weight_zero_point"], bits, 0)[: q.shape[0]].float()
    return q, zero, scale
