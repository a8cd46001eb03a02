"""What each layer's 8-bit checkpoint tensors mean: read from ``quantization_config`` into a ``Scheme`` per layer.

Three configurations name FP8 weights (the first also INT8 ones, ``type: int``, for the int8 plugin):

- compressed-tensors (llm-compressor): ``config_groups`` whose ``weights`` are ``{type: float, num_bits: 8}``
  with ``strategy`` channel (``weight_scale [out, 1]``), tensor (one ``weight_scale``) or block
  (``block_structure``), and ``input_activations`` dynamic per token (or per group) or static per tensor
  (``input_scale``); ``targets`` and ``ignore`` name modules ("Linear", a name, or "re:" + a regex).
- vLLM / AutoFP8, ``quant_method: fp8``: a per-tensor ``weight_scale`` and ``activation_scheme`` dynamic or
  static (``input_scale``).
- DeepSeek-V3, ``quant_method: fp8`` with ``weight_block_size [128, 128]``: ``weight_scale_inv`` per block, and
  activations quantized dynamically per 128 input features of each token.

A plain checkpoint (no config) is quantized at load: per-channel weight scales.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from fw.interfaces.quant import MOE_ROUTERS, ModuleSchemes
from fw.sdk.errors import ModelLoadError
from fw_quant_fp8.hooks import is_8bit_compressed_tensors
from fw_quant_fp8.numerics import E4M3, Element


@dataclass(frozen=True)
class Scheme:
    """One layer's format."""

    # How weight scales are laid out: per output row, per sub-matrix, or per [rows, columns] block.
    weights: Literal["channel", "tensor", "block"]
    # none: W8A16. dynamic: scales from each token (per ``activation_group`` input features when set).
    # static: the checkpoint's per-tensor ``input_scale``.
    activations: Literal["none", "dynamic", "static"] = "none"
    activation_group: int | None = None
    block: tuple[int, int] | None = None
    # The checkpoint's name of the weight scale ("weight_scale", DeepSeek's "weight_scale_inv").
    scale_name: str = "weight_scale"
    # A plain checkpoint: the float weight is quantized once loaded.
    online: bool = False
    # The checkpoint stores ``input_scale`` (loaded even where the plugin's option turns static scales off).
    input_scales: bool = False

    def group(self) -> int | None:
        """Input features per weight scale: None for one per row."""
        return self.block[1] if self.block else None


class Schemes(ModuleSchemes[Scheme]):
    """Checkpoint module name -> its ``Scheme``, or None for a layer the checkpoint leaves unquantized."""

    def __init__(self, quant_config: dict[str, Any], activations: str, element: Element = E4M3,
                 layers: str = "all") -> None:
        super().__init__()
        method = quant_config.get("quant_method")
        if quant_config and layers != "all":
            raise ModelLoadError(f"quant.layers={layers}: the checkpoint is already quantized (quant_method "
                                 f"{method!r}); the option chooses what a plain checkpoint has rounded at load")
        if layers == "lm_head":  # every linear layer stays in float; the method rounds the head alone
            self.groups, self.ignore = [], []
            return
        if not quant_config:
            self.groups = [(["Linear"], Scheme("channel", "dynamic" if activations == "dynamic" else "none",
                                               online=True))]
            # MoE routers stay in float, as llm-compressor's recipes leave them: a rounded router picks other experts.
            self.ignore = [MOE_ROUTERS]
            return
        if method == "fp8" and element is E4M3:
            block = quant_config.get("weight_block_size")
            scheme = quant_config.get("activation_scheme", "dynamic")
            if scheme not in ("dynamic", "static"):
                raise ModelLoadError(f"fp8 checkpoint: unknown activation_scheme {scheme!r}")
            if block:
                if scheme != "dynamic":
                    raise ModelLoadError("fp8 checkpoint: block-wise weights need activation_scheme dynamic")
                group = Scheme("block", "dynamic", block[1], tuple(block), "weight_scale_inv")
            else:
                group = Scheme("tensor", scheme, input_scales=scheme == "static")
            self.groups = [(["Linear"], group)]
            # MoE routers too: these checkpoints (DeepSeek-V3, Qwen3 FP8) keep them in 16 bits without listing them.
            self.ignore = [*(quant_config.get("ignored_layers") or quant_config.get("modules_to_not_convert") or []),
                           MOE_ROUTERS]
        elif is_8bit_compressed_tensors(quant_config, element.type):
            self.groups = [(g.get("targets") or ["Linear"], _compressed_tensors(name, g, element.type))
                           for name, g in quant_config["config_groups"].items()]
            self.ignore = list(quant_config.get("ignore") or [])
        else:
            raise ModelLoadError(f"8-bit {element.type} weights: cannot load quant_method {method!r} with this "
                                 "configuration")
        if activations != "auto":  # the option overrides what the checkpoint says
            self.groups = [(t, _with_activations(s, activations)) for t, s in self.groups]


def _with_activations(scheme: Scheme, activations: str) -> Scheme:
    group = scheme.activation_group if activations == scheme.activations == "dynamic" else None
    return replace(scheme, activations=activations, activation_group=group)


def _compressed_tensors(name: str, group: dict[str, Any], kind: str) -> Scheme:
    weights, acts = group["weights"], group.get("input_activations")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor", "block") or not weights.get("symmetric", True):
        raise ModelLoadError(f"compressed-tensors group {name}: 8-bit {kind} weights with strategy {strategy!r} "
                             f"{'symmetric' if weights.get('symmetric', True) else 'asymmetric'} (symmetric "
                             "channel, tensor or block are supported)")
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    if not acts:
        return Scheme(strategy, block=block)
    if acts.get("type") != kind or acts.get("num_bits") != 8 or not acts.get("symmetric", True):
        raise ModelLoadError(f"compressed-tensors group {name}: activations must be symmetric 8-bit {kind} too")
    kind = acts.get("strategy")
    if acts.get("dynamic") and kind in ("token", "group"):
        return Scheme(strategy, "dynamic", acts.get("group_size") if kind == "group" else None, block)
    if not acts.get("dynamic") and kind == "tensor":
        return Scheme(strategy, "static", block=block, input_scales=True)
    raise ModelLoadError(f"compressed-tensors group {name}: activations {kind!r} "
                         f"{'dynamic' if acts.get('dynamic') else 'static'} are not supported "
                         "(dynamic per token or group, static per tensor are)")
