"""What every plugin kind shares: the capability record and the model's requirements.

A plugin's capabilities are plain data so that listing and validating plugins
never imports their kernels. ``Capabilities.problems(req)`` returns every
reason the plugin cannot serve ``req``; the kind-specific records extend it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from typing import ClassVar

ALL_DEVICES = frozenset({"cpu", "cuda"})
FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})


@dataclass(frozen=True)
class Requirements:
    """What a model plus its run configuration needs from the plugins.

    Fields left ``None`` are unknown (e.g. no model given to ``fw plugins
    check``) and are not checked.
    """

    device: str = "cpu"
    compute_capability: tuple[int, int] | None = None
    num_devices: int = 1
    dtype: str | None = None
    head_size: int | None = None
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    quant_format: str | None = None
    architecture: str | None = None
    # Attention features needed: the model's ("mla", "sliding_window", "soft_cap"), and when validation looks
    # for alternatives, those another slot requires (a quant scheme's "fp8_kv").
    attention_features: frozenset[str] = frozenset()
    # A multi-head latent attention model's (kv_lora_rank, qk_rope_head_dim): the widths of its cached rows.
    mla_dims: tuple[int, int] | None = None


@dataclass(frozen=True)
class Capabilities:
    devices: frozenset[str] = ALL_DEVICES
    min_compute_capability: tuple[int, int] | None = None
    dtypes: frozenset[str] = FLOAT_DTYPES
    features: frozenset[str] = frozenset()
    # Python modules the implementation imports; checked with find_spec, never imported.
    requires_modules: tuple[str, ...] = ()
    min_devices: int = 1

    # Field -> every name it may hold. Checked when a spec is discovered, so that a typo ("bf16") marks the
    # plugin broken instead of surfacing as a mismatch at run time.
    KNOWN: ClassVar[dict[str, frozenset[str]]] = {"devices": ALL_DEVICES, "dtypes": FLOAT_DTYPES, "features": frozenset()}

    def unknown_names(self) -> list[str]:
        """One message per field that holds a name the core does not know."""
        out = []
        for name, known in self.KNOWN.items():
            unknown = sorted(set(getattr(self, name)) - known)
            if unknown:
                out.append(
                    f"capabilities.{name}: unknown {', '.join(map(repr, unknown))} "
                    f"(known: {', '.join(sorted(known)) or 'none for this kind'})"
                )
        return out

    def problems(self, req: Requirements) -> list[str]:
        out = []
        if req.device not in self.devices:
            out.append(f"needs device {' or '.join(sorted(self.devices))}, got {req.device}")
        need = ".".join(map(str, self.min_compute_capability or ()))
        if (
            req.device == "cuda"
            and self.min_compute_capability
            and req.compute_capability
            and req.compute_capability < self.min_compute_capability
        ):
            have = ".".join(map(str, req.compute_capability))
            out.append(f"needs compute capability >= {need}, got {have}")
        elif req.device != "cuda" and self.min_compute_capability:  # every reason, the GPU's kind included
            out.append(f"needs a CUDA GPU of compute capability >= {need}")
        if req.num_devices < self.min_devices:
            out.append(f"needs at least {self.min_devices} devices, got {req.num_devices}")
        if req.dtype and req.dtype not in self.dtypes:
            out.append(f"does not support dtype {req.dtype} (supports {', '.join(sorted(self.dtypes))})")
        missing = [m for m in self.requires_modules if importlib.util.find_spec(m.split(".")[0]) is None]
        if missing:
            out.append(f"needs the Python package(s) {', '.join(missing)}, which are not installed")
        return out

    def describe(self) -> dict[str, object]:
        """The record as plain values, for `fw plugins list/show`."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            # Devices and dtypes always show; other fields only where they differ from the default.
            if f.name not in ("devices", "dtypes") and value == f.default:
                continue
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
        return out


def supported_api_versions(current: int) -> tuple[int, int]:
    """The core accepts plugins written against the current and the previous API version (versions start at 1)."""
    return (max(current - 1, 1), current)


def frozen(*items: str) -> frozenset[str]:
    return frozenset(items)


__all__ = [
    "ALL_DEVICES",
    "FLOAT_DTYPES",
    "Capabilities",
    "Requirements",
    "frozen",
    "supported_api_versions",
]
