"""Building a loaded model from a checkpoint, and the core's own checkpoint format (``DirectoryFormat``).

A checkpoint's format (``fw.interfaces.checkpoint_format``) reads its config and weights; the model's layers
load the weights through the quant method the config names.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from fw import model_registry
from fw.interfaces.checkpoint_format import CheckpointFormat
from fw.sdk.checkpoint import iter_safetensors
from fw.sdk.errors import MissingWeightsError, ModelLoadError

if TYPE_CHECKING:
    from torch import nn

    from fw.models.base import HFConfig, ModelContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


class DirectoryFormat(CheckpointFormat):
    """A model directory: config.json, safetensors files (one, or shards an index names) and tokenizer.json, the
    last read by the engine (``--tokenizer`` may name another directory). Quantized checkpoints of this form (GPTQ,
    AWQ, compressed-tensors, FP8) name their quant format in config.json's ``quantization_config``."""

    def config(self, model_path: str) -> dict[str, Any]:
        return model_registry.read_hf_config(model_path)

    def weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(model_path)


def resolve_dtype(config: HFConfig, override: str | torch.dtype | None = None) -> torch.dtype:
    """The model dtype: ``override`` if given, else the config's ``dtype`` / ``torch_dtype``, else float32."""
    if isinstance(override, torch.dtype):
        name = str(override).removeprefix("torch.")
    else:
        name = override or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


def load_model(
    model_cls: type[nn.Module],
    config: HFConfig,
    ctx: ModelContext,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device = "cpu",
    kv_cache_dtype: str = "auto",
) -> nn.Module:
    """Construct ``model_cls`` on ``device`` in ``ctx.dtype``, load every parameter, and let each
    linear layer's quant method (and each core layer that has a ``process_weights_after_loading``)
    repack its weights. The checkpoint's KV-cache scales set the attention layers' ``k_scale`` and
    ``v_scale`` when ``kv_cache_dtype`` is fp8 (``KVCacheScales``)."""
    with torch.device(device):
        model = model_cls(config, ctx)
    kv_scales = KVCacheScales(model)
    loaded = model.load_weights(kv_scales.take(weights))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        raise MissingWeightsError(missing)
    kv_scales.apply(kv_cache_dtype, config.get("quantization_config") or {})
    for module in model.modules():
        method: Any = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):  # core layers that repack (the LM head)
            module.process_weights_after_loading()
    return model.eval()


# A per-tensor KV-cache scale, named after the checkpoint's attention module (".../self_attn", group 1):
# k_scale / v_scale (compressed-tensors, vLLM fp8), kv_scale for both (AutoFP8, TGI), k_proj.output_scale
# (compressed-tensors before k_scale), k_proj.k_scale (ModelOpt); vLLM's own names add ".attn".
KV_SCALE_NAME = re.compile(r"(.+?)\.(?:(k|v|kv)_scale|([kv])_proj\.(?:output_scale|\3_scale))")


class KVCacheScales:
    """The checkpoint's KV-cache scales, taken out of the weights and set on the attention layers' specs.

    As vLLM: an fp8 cache stores K / k_scale and V / v_scale with the checkpoint's scales, 1.0 where it has
    none; any other cache dtype ignores them. A scale that is not one positive finite number, or a
    ``kv_cache_scheme`` other than static per-tensor fp8, is a load error under fp8: 1.0 instead would
    silently saturate or rescale every cached key.
    """

    def __init__(self, model: nn.Module) -> None:
        from fw.layers.attention import Attention

        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
        self.found: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # layer -> "k" | "v" | "kv" -> tensor

    def _layer(self, module: str) -> str | None:
        return next((n for n in (f"{module}.attn", module) if n in self.layers), None)

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` without the KV-cache scales of this model's attention layers, which it keeps."""
        for name, tensor in weights:
            match = KV_SCALE_NAME.fullmatch(name)
            layer = match and self._layer(match[1])
            if layer:
                self.found.setdefault(layer, {})[match[2] or match[3]] = (name, tensor)
            else:
                yield name, tensor

    def apply(self, kv_cache_dtype: str, quant_config: Mapping[str, Any]) -> None:
        if kv_cache_dtype != "fp8":
            if self.found:
                logger.info("the checkpoint's KV-cache scales are unused: the KV-cache dtype is %s", kv_cache_dtype)
            return
        scheme = quant_config.get("kv_cache_scheme")
        if scheme:
            _check_kv_cache_scheme(scheme)
        unscaled = []
        for name, layer in self.layers.items():
            found = self.found.get(name, {})
            k, v = found.get("k") or found.get("kv"), found.get("v") or found.get("kv")
            if k is None or v is None:
                unscaled.append(name)
            layer.spec = replace(layer.spec, k_scale=_kv_scale(k), v_scale=_kv_scale(v))
        if unscaled and (scheme or self.found):
            logger.warning(
                "the checkpoint has no KV-cache scale for K or V of %s: using 1.0 there", ", ".join(unscaled)
            )


def _kv_scale(found: tuple[str, torch.Tensor] | None) -> float:
    if found is None:
        return 1.0
    name, tensor = found
    if tensor.numel() != 1:
        raise ModelLoadError(
            f"{name} has shape {tuple(tensor.shape)}: an fp8 KV cache takes one scale per layer for K and one for V"
        )
    value = tensor.float().item()
    if not (math.isfinite(value) and value > 0):
        raise ModelLoadError(f"{name} = {value}: a KV-cache scale must be positive and finite")
    return value


def _check_kv_cache_scheme(scheme: Mapping[str, Any]) -> None:
    """compressed-tensors' ``kv_cache_scheme`` (absent keys take QuantizationArgs' defaults): --kv-cache-dtype fp8
    reads static symmetric per-tensor fp8 scales."""
    defaults = {"type": "int", "num_bits": 8, "strategy": "tensor", "symmetric": True, "dynamic": False}
    wanted = {**defaults, "type": "float"}
    values = {key: default if scheme.get(key) is None else scheme[key] for key, default in defaults.items()}
    wrong = [f"{key} {values[key]!r}" for key, want in wanted.items() if values[key] != want]
    if wrong:
        raise ModelLoadError(
            f"quantization_config.kv_cache_scheme has {', '.join(wrong)}: --kv-cache-dtype fp8 takes the "
            "checkpoint's KV-cache scales only from a static symmetric per-tensor 8-bit float scheme"
        )
