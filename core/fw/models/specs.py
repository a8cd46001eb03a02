"""Entry-point specs of the built-in architectures (light: no torch import)."""

from fw.interfaces.base import frozen
from fw.interfaces.model import ModelCapabilities
from fw.interfaces.spec import BUILTIN_PRIORITY, PluginSpec


def _spec(
    name: str, impl: str, architectures: frozenset[str], description: str, requires: frozenset[str] = frozenset()
) -> PluginSpec:
    return PluginSpec(
        name=name,
        kind="models",
        impl=impl,
        capabilities=ModelCapabilities(
            architectures=architectures,
            devices=frozen("cpu", "cuda"),
            requires_attention_features=requires,
            features=frozen("pipeline_parallel"),  # every built-in is a fw.models.llama decoder
        ),
        api_version=1,  # the model interface these are written against (a literal, as AUTHORING asks)
        description=description,
        priority=BUILTIN_PRIORITY,
    )


LLAMA = _spec(
    "llama",
    "fw.models.llama:LlamaForCausalLM",
    frozen("LlamaForCausalLM", "MistralForCausalLM"),
    "Llama 2/3 and Mistral decoders (RoPE scaling: linear, llama3, yarn; Mistral sliding window).",
)
QWEN2 = _spec(
    "qwen2",
    "fw.models.llama:Qwen2ForCausalLM",
    frozen("Qwen2ForCausalLM"),
    "Qwen2 / Qwen2.5 decoders (q/k/v bias, optional sliding window).",
)
QWEN3 = _spec(
    "qwen3", "fw.models.llama:Qwen3ForCausalLM", frozen("Qwen3ForCausalLM"), "Qwen3 decoders (per-head q/k RMSNorm)."
)
MIXTRAL = _spec(
    "mixtral",
    "fw.models.moe:MixtralForCausalLM",
    frozen("MixtralForCausalLM"),
    "Mixtral sparse mixture of experts (top-k renormalized routing).",
)
QWEN2_MOE = _spec(
    "qwen2_moe",
    "fw.models.moe:Qwen2MoeForCausalLM",
    frozen("Qwen2MoeForCausalLM"),
    "Qwen1.5/Qwen2 MoE (routed experts plus a sigmoid-gated shared expert).",
)
QWEN3_MOE = _spec(
    "qwen3_moe",
    "fw.models.moe:Qwen3MoeForCausalLM",
    frozen("Qwen3MoeForCausalLM"),
    "Qwen3 MoE (q/k RMSNorm, norm_topk_prob routing).",
)
DEEPSEEK_V2 = _spec(
    "deepseek_v2",
    "fw.models.deepseek:DeepseekV2ForCausalLM",
    frozen("DeepseekV2ForCausalLM"),
    "DeepSeek-V2 / V2-Lite (multi-head latent attention; softmax-routed experts plus shared experts).",
    requires=frozen("mla"),
)
DEEPSEEK_V3 = _spec(
    "deepseek_v3",
    "fw.models.deepseek:DeepseekV3ForCausalLM",
    frozen("DeepseekV3ForCausalLM"),
    "DeepSeek-V3 / R1 (multi-head latent attention; sigmoid, bias-corrected, group-limited expert routing).",
    requires=frozen("mla"),
)
