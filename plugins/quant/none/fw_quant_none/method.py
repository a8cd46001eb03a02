"""The unquantized quant method: every linear layer is the SDK's ``UnquantizedLinearMethod``."""

from __future__ import annotations

from fw.interfaces.quant import LinearMethod, LinearSpec, QuantMethod
from fw.sdk.linear import UnquantizedLinearMethod


class Unquantized(QuantMethod):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        # Stateless, so every layer can share one instance.
        return _LINEAR


_LINEAR = UnquantizedLinearMethod()
