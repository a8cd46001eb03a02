"""8-bit routed experts: ``w13_*`` (gate rows, then up rows) and ``w2_*`` stacked per expert, in the linear layers'
formats (``method``): 8-bit weights, float32 per-row scales ``[E, rows, groups]``, per-projection
``input_scale``. Each expert widens its weights into the activation dtype when it runs."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from fw.interfaces.quant import MoEMethod, MoESpec
from fw.sdk.activation import silu_and_mul
from fw.sdk.moe import run_experts
from fw_quant_fp8.method import check_blocks, load_scale, new_param
from fw_quant_fp8.numerics import Element, dequantize, quantize_input, quantize_rows
from fw_quant_fp8.scheme import Scheme

# Which column of a stacked ``input_scale`` each projection's scale loads into.
_INPUT_COLUMN = {"w1": 0, "w3": 1, "w2": 0}


class Fp8MoEMethod(MoEMethod):
    def __init__(self, scheme: Scheme, element: Element) -> None:
        self.scheme, self.element = scheme, element

    def create_weights(self, layer: nn.Module, spec: MoESpec) -> None:
        scheme, e, h, i = self.scheme, spec.num_experts, spec.hidden_size, spec.intermediate_size
        check_blocks(scheme, i, spec.tp_size > 1, f"{spec.prefix}.w2")
        group = scheme.group()

        def rows_needed(shard_id: tuple[int, str]) -> int:  # gate and up are split by rows, down is not
            return h if shard_id[1] == "w2" else (spec.tp_rank + 1) * i

        for stem, (rows, width), projections in (("w13_", (2 * i, h), 2), ("w2_", (h, i), 1)):
            dtype = spec.params_dtype if scheme.online else self.element.dtype
            layer.register_parameter(f"{stem}weight", new_param((e, rows, width), dtype, 0, 1))
            if scheme.online:
                continue
            scale = new_param((e, rows, -(-width // group) if group else 1), torch.float32, 0, 1 if group else None)
            scale.weight_loader = partial(load_scale, scheme, layer.weight_loader, rows_needed)
            layer.register_parameter(f"{stem}{scheme.scale_name}", scale)
            if scheme.input_scales:
                input_scale = new_param((e, projections), torch.float32, None, None)
                input_scale.weight_loader = _load_input_scale
                layer.register_parameter(f"{stem}input_scale", input_scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.scheme.online:
            return
        for stem in ("w13_", "w2_"):
            weight, scale = quantize_rows(getattr(layer, f"{stem}weight"), self.element)
            delattr(layer, f"{stem}weight")
            layer.register_buffer(f"{stem}weight", weight, persistent=False)
            layer.register_buffer(f"{stem}weight_scale", scale, persistent=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        scheme, name = self.scheme, "weight_scale" if self.scheme.online else self.scheme.scale_name
        w13, w2 = layer.w13_weight, layer.w2_weight
        s13, s2 = getattr(layer, f"w13_{name}"), getattr(layer, f"w2_{name}")
        static = scheme.activations == "static"

        def project(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    input_scales: torch.Tensor | None) -> torch.Tensor:
            if scheme.activations == "dynamic":
                rows = quantize_input(rows, None, scheme.activation_group, self.element)
            if input_scales is None:
                return F.linear(rows, dequantize(weight, scale, scheme.group(), rows.dtype))
            # Static: each projection (gate, up) quantizes its own input, as the reference's separate modules do.
            parts = zip(weight.chunk(len(input_scales)), scale.chunk(len(input_scales)), input_scales, strict=True)
            return torch.cat([F.linear(quantize_input(rows, s, element=self.element),
                                       dequantize(w, ws, scheme.group(), rows.dtype)) for w, ws, s in parts], dim=-1)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = project(rows, w13[e], s13[e], layer.w13_input_scale[e] if static else None)
            return project(silu_and_mul(gate_up), w2[e], s2[e], layer.w2_input_scale[e] if static else None)

        return run_experts(x, topk_weights, topk_ids, w13.shape[0], expert)


def _load_input_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
    expert, which = shard_id
    param.data[expert, _INPUT_COLUMN[which]] = loaded.reshape(())
