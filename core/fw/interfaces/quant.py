"""Quantization interface (plugin kind ``fw.quant``).

A quant plugin's implementation is a ``QuantMethod``: it hands every linear
layer a ``LinearMethod`` that creates the layer's parameters (in whatever
packed form the checkpoint stores them) and computes ``x @ W.T + b``, and
every layer of routed experts a ``MoEMethod`` (by default unquantized). Each
layer describes itself in a ``LinearSpec`` / ``MoESpec``: sizes, the
checkpoint names of what it fuses, the tensor-parallel split. That spec and
the parameters a method registers are the whole contract between the two.
The unquantized path is itself a plugin (``none``), built from the SDK's
``fw.sdk.linear.UnquantizedLinearMethod``.

A quant method never reads files: the checkpoint's format does
(``fw.interfaces.checkpoint_format``), and its config's
``quantization_config.quant_method`` (or a ``fw_detect_quant_format`` hook,
for schemes that share one quant_method) names the weights' quant format.
"auto" chooses the highest-priority plugin whose ``QuantCapabilities.formats``
lists it ("none", priority 10, for plain weights; a plugin that also loads
plain checkpoints runs when named, or above it).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from fw.interfaces.attention import FEATURES
from fw.interfaces.base import Capabilities, Requirements

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

# 2: get_linear_method/create_weights take a LinearSpec; get_moe_method added. v1 plugins run through adapt().
API_VERSION = 2


@dataclass(frozen=True)
class QuantCapabilities(Capabilities):
    # Quant formats this plugin loads, as a checkpoint's config names them ("fp8", "awq", "gptq", "gguf"; see the
    # module docstring); "none" for plain weights.
    formats: frozenset[str] = frozenset({"none"})
    # Attention features this scheme needs (e.g. "fp8_kv"); checked against the chosen backend.
    requires_attention_features: frozenset[str] = frozenset()

    KNOWN: ClassVar[dict[str, frozenset[str]]] = {**Capabilities.KNOWN, "requires_attention_features": FEATURES}

    def problems(self, req: Requirements) -> list[str]:
        out = super().problems(req)
        fmt = req.quant_format or "none"
        if fmt not in self.formats:
            out.append(f"cannot load {fmt!r} checkpoints (loads: {', '.join(sorted(self.formats))})")
        return out


@dataclass(frozen=True)
class LinearSpec:
    """Everything a quant method may know about one linear layer; the layer's other attributes are not API.

    Sizes are this tensor-parallel rank's. A fused layer (q/k/v, gate/up) holds several checkpoint
    sub-matrices stacked along its output features, in the order of ``checkpoint_names``.
    """

    # fw's name of the layer, e.g. "model.layers.0.self_attn.qkv_proj".
    prefix: str
    # Input features of this rank (a row-parallel layer's share).
    input_size: int
    # Output features of each sub-matrix on this rank, in checkpoint order.
    output_sizes: tuple[int, ...]
    # Each sub-matrix's module name in the checkpoint ("...self_attn.q_proj"): its tensors are
    # f"{name}.{leaf}" ("weight", "weight_scale", ...), loaded into the layer's parameter ``leaf``.
    checkpoint_names: tuple[str, ...]
    # The ``shard_id`` each sub-matrix's tensors are loaded with: ("q", "k", "v"), (0, 1), or (None,) unfused.
    shard_ids: tuple[Any, ...]
    params_dtype: torch.dtype
    tp_rank: int = 0
    tp_size: int = 1
    # Row-parallel: each rank holds a contiguous 1/tp_size of the input features (sums are all-reduced).
    input_is_parallel: bool = False
    # Column-parallel: each rank holds a contiguous 1/tp_size of every sub-matrix's output features.
    output_is_parallel: bool = False
    # Which rank-sized slice of each sub-matrix this rank holds: tp_rank, except for KV heads replicated
    # over several ranks. Empty means tp_rank for every sub-matrix.
    shard_ranks: tuple[int, ...] = ()

    def shard_index(self, shard_id: Any) -> int:
        """The position of the sub-matrix loaded with ``shard_id``."""
        if shard_id not in self.shard_ids:
            raise ValueError(f"{self.prefix} fuses shards {self.shard_ids}: no shard {shard_id!r}")
        return self.shard_ids.index(shard_id)

    def shard_rank(self, index: int) -> int:
        return self.shard_ranks[index] if self.shard_ranks else self.tp_rank


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight."""

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, spec: LinearSpec) -> None:
        """Register the parameters on ``layer``, sized for this rank, named after the checkpoint tensors' leaf.

        Each parameter carries ``output_dim`` / ``input_dim`` (the dimension holding output / input
        features, or None) for the layer's own loader, which places each checkpoint tensor: the
        sub-matrix's rows along ``output_dim`` (scaled for packed rows), this rank's slice along the
        split dimension. A parameter may bring its own ``weight_loader(param, tensor, shard_id)``
        instead, using ``spec`` to find its place.
        """

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Compute ``x @ W.T (+ bias)`` for ``x`` of shape [..., input_size]."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights for the kernel (transpose, pre-dequantize, ...)."""


@dataclass(frozen=True)
class MoESpec:
    """One mixture-of-experts layer's routed experts, each a gated MLP ``w2 @ (silu(w1 x) * w3 x)``.

    Every rank holds every expert, with this rank's share of the MLP width: w1/w3 (gate/up) split by
    output features, w2 (down) by input features, like a column- then a row-parallel linear layer. Under
    expert parallelism a rank holds ``num_experts`` whole experts instead (``tp_size`` 1), and the layer maps
    global expert ids to these local ones, before loading and before ``apply``.
    """

    # fw's name of the layer, e.g. "model.layers.0.mlp.experts".
    prefix: str
    num_experts: int
    hidden_size: int
    # This rank's share of each expert's MLP width.
    intermediate_size: int
    # The checkpoint's name of the experts ("model.layers.0.block_sparse_moe.experts") and of the gate, up
    # and down projections of each ("w1", "w3", "w2" or "gate_proj", "up_proj", "down_proj"): expert e's
    # tensors are f"{checkpoint_prefix}.{e}.{projection}.{leaf}".
    checkpoint_prefix: str
    projections: tuple[str, str, str]
    params_dtype: torch.dtype
    tp_rank: int = 0
    tp_size: int = 1


class MoEMethod(ABC):
    """How one MoE layer stores its stacked experts and computes them.

    Parameters are ``w13_<leaf>`` (gate rows, then up rows, per expert) and ``w2_<leaf>``, each stacked
    along a leading expert dimension; the checkpoint's ``...{e}.{projection}.{leaf}`` tensors load into
    them with ``shard_id`` (e, "w1" | "w3" | "w2"). ``output_dim`` / ``input_dim`` name the dimensions of
    one expert's slice ``param[e]``, as a linear layer's do; the layer's loader then places gate and up
    halves and this rank's slice. A parameter may bring its own ``weight_loader`` instead.
    """

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, spec: MoESpec) -> None:
        """Register the stacked parameters on ``layer``, sized for this rank."""

    @abstractmethod
    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for ``x`` [T, hidden]; this rank's partial sum.
        An id of -1 (another rank's expert, under expert parallelism) contributes nothing: ``run_experts`` skips it."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights for the kernel."""


S = TypeVar("S")

# MoE routers (and Qwen2-MoE's shared-expert gate): the quantization tools leave them in float, since a rounded
# router picks other experts.
MOE_ROUTERS = r"re:.*(mlp|block_sparse_moe)\.(gate|shared_expert_gate)$"


def matches_module(pattern: str, name: str) -> bool:
    """A quantization config's module pattern (compressed-tensors' ``targets``/``ignore``, vLLM's skip lists):
    "re:" + a regex matched from the start, else a module name or the last parts of one."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or name.endswith(f".{pattern}")


class ModuleSchemes(Generic[S]):
    """Checkpoint module name -> the scheme its config gives it, or None for a module left in float: the first
    of ``groups`` (targets, scheme) whose targets match ("Linear": every linear layer), unless ``ignore`` matches.
    A quant plugin fills both from its config."""

    def __init__(self) -> None:
        self.ignore: list[str] = []
        self.groups: list[tuple[list[str], S]] = []

    def __call__(self, name: str) -> S | None:
        if any(matches_module(p, name) for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(t == "Linear" or matches_module(t, name) for t in targets):
                return scheme
        return None

    def common(self, names: tuple[str, ...], prefix: str) -> S | None:
        """The one scheme of the checkpoint matrices a layer fuses (q/k/v, gate/up, one layer's experts)."""
        from fw.sdk.errors import ModelLoadError

        schemes = {self(n) for n in names}
        if len(schemes) > 1:
            raise ModelLoadError(f"{prefix} fuses {', '.join(names)}, which the checkpoint quantizes differently")
        return schemes.pop()


class QuantMethod(ABC):
    api_version = API_VERSION

    def __init__(self, options: BaseModel | None = None, quant_config: dict[str, Any] | None = None) -> None:
        self.options = options
        # The checkpoint config's quantization_config, as its checkpoint format read it.
        self.quant_config = quant_config or {}

    @abstractmethod
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        """The method for the linear layer ``spec`` describes."""

    def get_moe_method(self, spec: MoESpec) -> MoEMethod | None:
        """The method for a layer of routed experts. None, the default, keeps them unquantized (the layer then
        uses ``fw.sdk.moe.UnquantizedMoEMethod``, which a plugin may also return for experts it leaves in float)."""
        return None

    def get_logits_method(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A product for the LM head, made from its loaded float weight (this rank's vocabulary rows; the
        embedding's table when tied, which the lookup keeps using): hidden states -> float32 logits. None, the
        default, keeps the head in float: its rounding moves the logits more than any other layer's."""
        return None


def adapt(impl: type[QuantMethod], api_version: int) -> type[QuantMethod]:
    """``impl`` as a plugin of this API, for one written against ``api_version`` (this or the previous one).

    v1 methods took ``get_linear_method(prefix)`` and ``create_weights(layer, input_size, output_sizes,
    params_dtype)``; the adapter calls them so, from the spec. v1 had no MoE method: experts stay unquantized.
    """
    if api_version >= API_VERSION:
        return impl

    class V1(impl):  # type: ignore[valid-type, misc]
        def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
            return _V1LinearMethod(super().get_linear_method(spec.prefix))

    V1.api_version = api_version
    V1.__name__ = V1.__qualname__ = impl.__name__
    return V1


class _V1LinearMethod(LinearMethod):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_weights(self, layer: torch.nn.Module, spec: LinearSpec) -> None:
        self.inner.create_weights(layer, spec.input_size, list(spec.output_sizes), spec.params_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.apply(layer, x, bias)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)
