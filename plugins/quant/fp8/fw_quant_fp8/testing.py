"""Small 8-bit checkpoints of each format the fp8 and int8 plugins load, written from a plain one, and their
dequantized weights: the plugins' ``QuantConformance`` fixtures, and what their tests load. Written from the
formats' documentation (the tests check them against transformers + compressed-tensors)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fw.sdk.checkpoint import iter_safetensors
from fw_quant_fp8.numerics import E4M3, Element, dequantize, quantize_rows

# Layers every format leaves in float: the MoE routers, as llm-compressor's recipes do. (The LM head and the
# embeddings are no linear layers in the checkpoints written here.)
ROUTER_PATTERN = r"re:.*(mlp|block_sparse_moe)\.gate$"


def _quantize(weight: torch.Tensor, weights: str, block: tuple[int, int],
              element: Element) -> tuple[torch.Tensor, torch.Tensor]:
    """(8-bit weight, its scale as the checkpoint stores it): channel [out, 1], tensor [], or block
    [ceil(out / b0), ceil(in / b1)]."""
    w = weight.float()
    if weights == "channel":
        scale = element.scale(w.abs().amax(dim=1, keepdim=True))
        expanded = scale
    elif weights == "tensor":
        scale = expanded = element.scale(w.abs().amax())
    else:
        (out, width), (b0, b1) = w.shape, block
        padded = torch.nn.functional.pad(w.abs(), (0, -width % b1, 0, -out % b0))
        scale = element.scale(padded.unflatten(1, (-1, b1)).unflatten(0, (-1, b0)).amax(dim=(1, 3)))
        expanded = scale.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :width]
    return element.round(w / expanded), scale


def write_checkpoint(plain: Path, out: Path, *, kind: str = "compressed-tensors", weights: str = "channel",
                     activations: str | None = "dynamic", block: tuple[int, int] = (128, 128),
                     element: Element = E4M3) -> Path:
    """``plain`` with every decoder-layer matrix but the routers in FP8 (or another 8-bit ``element``).

    ``kind`` "compressed-tensors" (``weights`` channel or tensor; ``activations`` None, "dynamic" per token or
    "static"), "fp8" (vLLM/AutoFP8: per-tensor scales; ``activations`` "dynamic" or "static"), or "block"
    (DeepSeek-V3: ``weight_block_size`` = ``block``). Static input scales differ between the matrices of a layer.
    """
    if kind != "compressed-tensors":
        weights = "block" if kind == "block" else "tensor"
    scale_name = "weight_scale_inv" if kind == "block" else "weight_scale"
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(iter_safetensors(plain)):
        module = name.removesuffix(".weight")
        if ".layers." in name and tensor.dim() == 2 and not _is_router(module):
            q, scale = _quantize(tensor, weights, block, element)
            # compressed-tensors stores one-element scales as [1], AutoFP8 as scalars.
            shape = [1] if kind == "compressed-tensors" else []
            tensors[name], tensors[f"{module}.{scale_name}"] = q, scale.reshape(shape) if scale.dim() == 0 else scale
            if activations == "static":
                tensors[f"{module}.input_scale"] = torch.tensor(0.01 * (1 + i % 3)).reshape(shape)
        else:
            tensors[name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = _config(kind, weights, activations, block, element)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (plain / extra).is_file():
            shutil.copy(plain / extra, out / extra)
    return out


def _is_router(module: str) -> bool:
    return module.endswith((".mlp.gate", ".block_sparse_moe.gate"))


def _config(kind: str, weights: str, activations: str | None, block: tuple[int, int],
            element: Element) -> dict[str, Any]:
    if kind == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if kind == "fp8":
        return {"quant_method": "fp8", "activation_scheme": activations}
    args = {"num_bits": 8, "type": element.type, "symmetric": True}
    group: dict[str, Any] = {"targets": ["Linear"], "weights": {**args, "strategy": weights, "dynamic": False}}
    if activations == "dynamic":
        group["input_activations"] = {**args, "strategy": "token", "dynamic": True}
    elif activations == "static":
        group["input_activations"] = {**args, "strategy": "tensor", "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": f"{element.type}-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head", ROUTER_PATTERN]}


def rounded_at_load(checkpoint: Path, _options: Any = None,
                    element: Element = E4M3) -> Iterator[tuple[str, torch.Tensor]]:
    """A plain checkpoint's tensors as ``--quant fp8`` (or ``element``'s plugin) rounds them: every decoder-layer
    matrix but the routers per output row."""
    for name, tensor in iter_safetensors(checkpoint):
        if ".layers." in name and tensor.dim() == 2 and not _is_router(name.removesuffix(".weight")):
            tensor = dequantize(*quantize_rows(tensor, element), None, torch.float32)
        yield name, tensor


def dequantized(checkpoint: Path, _options: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every 8-bit weight times its scale, in float32; scales dropped."""
    tensors = dict(iter_safetensors(checkpoint))
    block = json.loads((checkpoint / "config.json").read_text())["quantization_config"].get("weight_block_size")
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if tensor.dtype in (torch.float8_e4m3fn, torch.int8):
            scale = tensors.get(f"{module}.weight_scale", tensors.get(f"{module}.weight_scale_inv")).float()
            if block:
                scale = scale.repeat_interleave(block[0], 0)[: tensor.shape[0]]
            yield name, dequantize(tensor, scale.reshape(-1, 1) if scale.dim() < 2 else scale,
                                   block[1] if block else None, torch.float32)
        elif leaf not in ("weight_scale", "weight_scale_inv", "input_scale"):
            yield name, tensor
