# The entry point names this module: keep it light (no torch), so `fw plugins list` stays fast.
from pydantic import BaseModel, Field

from fw.interfaces import quant
from fw.interfaces.base import frozen
from fw.interfaces.spec import PluginSpec


class RtnOptions(BaseModel, extra="forbid"):
    skip: list[str] = Field(
        default_factory=list,
        description="Layers left unquantized, by the last part of their checkpoint name (e.g. o_proj); a fused "
        "layer (q/k/v, gate/up) stays unquantized when any of its parts is named.",
    )


SPEC = PluginSpec(
    name="rtn",
    kind="quant",
    impl="fw_quant_rtn.method:RtnMethod",
    # It loads plain checkpoints ("none") and quantizes them as they load. At the default priority (0) it never
    # replaces the built-in `none` (priority 10) under --quant auto: users choose it with --quant rtn.
    capabilities=quant.QuantCapabilities(formats=frozen("none"), dtypes=frozen("float32", "bfloat16", "float16")),
    api_version=2,  # the quant API this plugin is written against (a literal: quant.API_VERSION moves with fw)
    description="int8 weight-only: each linear weight row as int8 times one scale (4x smaller than float32).",
    options=RtnOptions,
)
