"""Small integer checkpoints of every layout the plugins load, written from a plain one by round-to-nearest
(the layouts are GPTQ's, AWQ's and compressed-tensors', documented in ``formats``; how the integers were chosen
does not matter to a loader), and their dequantized weights: the ``QuantConformance`` fixtures and what the
tests load. The tests check the layouts against their own tools where those are installed."""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fw.interfaces.quant import MOE_ROUTERS, matches_module
from fw.sdk.checkpoint import iter_safetensors
from fw_quant_gptq.formats import AWQ_NIBBLE, V1_ONES, Scheme, Schemes, decode, in_features, pack, shift_words
from fw_quant_gptq.packed import matrix, repack

# Matrices that read the same input share GPTQ's act-order permutation (it comes from that input's statistics).
_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "in", "up_proj": "in",
                 "w1": "in", "w3": "in"}


def group_index(module: str, width: int, group: int, act_order: bool) -> torch.Tensor:
    """Each input feature's group: in order, or (act-order) by position in a permutation of the features."""
    per = width if group == -1 else group
    if not act_order:
        return torch.arange(width) // per
    parent, _, leaf = module.rpartition(".")
    seed = zlib.crc32(f"{parent}.{_SHARED_INPUT.get(leaf, leaf)}".encode())
    perm = torch.randperm(width, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(width, dtype=torch.long)
    g_idx[perm] = torch.arange(width) // per
    return g_idx


def quantize(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, symmetric: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest: (q uint8 [N, K], zero [N, G] integers, scale float16 [N, G]), W ~ scale * (q - zero)."""
    w, top = weight.float(), (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    members = [g_idx == g for g in range(groups)]
    lo = torch.stack([w[:, m].amin(1).clamp(max=0) for m in members], 1)
    hi = torch.stack([w[:, m].amax(1).clamp(min=0) for m in members], 1)
    if symmetric:
        scale = (torch.maximum(-lo, hi) * 2 / top).clamp(min=1e-6).half()
        zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.float32)
    else:
        scale = ((hi - lo) / top).clamp(min=1e-6).half()
        zero = (-lo / scale.float()).round().clamp(0, top)
    q = (w / scale.float()[:, g_idx]).round() + zero[:, g_idx]
    return q.clamp(0, top).to(torch.uint8), zero, scale


def _encode(layout: str, bits: int, q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor,
            symmetric: bool, act_order: bool) -> dict[str, torch.Tensor]:
    zero = zero.to(torch.uint8)
    if layout == "gptq":
        return {"qweight": pack(q.T, bits, 0), "qzeros": shift_words(pack(zero.T, bits, 1), -V1_ONES[bits]),
                "scales": scale.T.contiguous(), "g_idx": g_idx.int()}
    if layout == "awq":
        return {"qweight": pack(q.T, bits, 1, AWQ_NIBBLE), "qzeros": pack(zero.T, bits, 1, AWQ_NIBBLE),
                "scales": scale.T.contiguous()}
    # llm-compressor stores scales in the model's dtype: float32 for these tiny models.
    out = {"weight_packed": pack(q, bits, 1), "weight_scale": scale.float(), "weight_shape": torch.tensor(q.shape)}
    if not symmetric:
        out["weight_zero_point"] = pack(zero, bits, 0)
    if act_order:
        out["weight_g_idx"] = g_idx.int()
    return out


def _config(layout: str, bits: int, group: int, symmetric: bool, act_order: bool) -> dict[str, Any]:
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": symmetric,
                "true_sequential": True, "checkpoint_format": "gptq"}
    if layout == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
               "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head", MOE_ROUTERS]}


def write_checkpoint(plain: Path, out: Path, *, layout: str = "gptq", bits: int = 4, group: int = 32,
                     symmetric: bool = True, act_order: bool = False) -> Path:
    """``plain`` with every decoder-layer matrix but the MoE routers in ``layout`` ("gptq", "awq" or
    "pack-quantized"); act-order gives matrices that share an input one permutation."""
    if layout == "awq":
        symmetric = False  # AWQ stores zero points (zero_point: true)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(plain):
        module = name.removesuffix(".weight")
        if ".layers." in name and tensor.dim() == 2 and not matches_module(MOE_ROUTERS, module):
            g_idx = group_index(module, tensor.shape[1], group, act_order)
            q, zero, scale = quantize(tensor, bits, g_idx, symmetric)
            for leaf, value in _encode(layout, bits, q, zero, scale, g_idx, symmetric, act_order).items():
                tensors[f"{module}.{leaf}"] = value
        else:
            tensors[name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = _config(layout, bits, group, symmetric, act_order)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (plain / extra).is_file():
            shutil.copy(plain / extra, out / extra)
    return out


_PACKED = ("qweight", "weight_packed")


def dequantized(checkpoint: Path, _options: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every integer matrix as the float32 ``weight`` it stands for."""
    tensors = dict(iter_safetensors(checkpoint))
    schemes = Schemes(json.loads((checkpoint / "config.json").read_text())["quantization_config"])
    leaves = {"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
              "weight_shape", "weight_g_idx"}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf in _PACKED:
            yield f"{module}.weight", weight_of(schemes(module), {k.rpartition(".")[2]: v for k, v in tensors.items()
                                                                 if k.rpartition(".")[0] == module})
        elif leaf not in leaves:
            yield name, tensor


def weight_of(scheme: Scheme, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One checkpoint module's weight, float32 [N, K] in the checkpoint's input order."""
    width = in_features(scheme, t)
    q, zero, scale = decode(scheme, t, width)
    g = t.get("g_idx", t.get("weight_g_idx"))
    if g is None or not scheme.act_order:
        g = torch.arange(width) // (width if scheme.group == -1 else scheme.group)
    return matrix(repack(scheme.bits, q, zero, scale, g))
