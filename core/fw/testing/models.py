"""Tiny random-weight checkpoints of every built-in architecture, for parity tests.

``make_tiny_model`` builds the architecture with ``transformers`` (imported
lazily: only tests need it), fills every weight from a seeded generator, and
saves it as safetensors with a real byte-level BPE tokenizer, so that a test
can compare Flywheel's logits with transformers' on the same checkpoint and
drive the engine end to end with text.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
VOCAB_SIZE = 512
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A Hermes-style template with tools (Qwen2.5's format, written for these tests): the tools as JSON schemas in the
# system turn, each call of an assistant turn in <tool_call> tags, tool results as <tool_response> user turns.
TOOLS_TEMPLATE = (
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}{% if system %}{{ system + '\n\n' }}{% endif %}"
    "{{ 'Functions you may call, as JSON schemas:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\nTo call one, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n' }}"
    "{% elif system %}{{ '<|im_start|>system\n' + system + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif not (loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{{ '\n<tool_call>{\"name\": ' }}{{ call['function']['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{{ arguments if arguments is string else arguments | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough English, code and non-Latin text for a few hundred merges; byte-level BPE encodes anything anyway.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Once upon a time, there was a little robot who wanted to learn how to paint the sky at sunset.",
    "Large language models predict the next token given the previous tokens in the sequence.",
    "The inference engine schedules requests, allocates key-value cache blocks and samples tokens.",
    "Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris?",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += values[i]; }\nreturn sum;\n",
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T\nprint(y.shape)\n",
    '{"name": "flywheel", "version": "0.1.0", "tags": ["llm", "inference"], "ok": true}',
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;",
    "Le renard brun rapide saute par-dessus le chien paresseux. Bonjour tout le monde !",
    "Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München.",
    "El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?",
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。",
    "素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界！",
    "빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요!",
    "الثعلب البني السريع يقفز فوق الكلب الكسول.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828 -1 +1 = != <= >=",
    "Emoji and symbols: 🙂 🚀 ✓ → ∑ ∞ © ® € £ ¥",
]

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
    eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
    pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
    tie_word_embeddings=False,
)

# DeepSeek's multi-head latent attention, and a dense layer 0 (first_k_dense_replace) before the experts.
_MLA: dict[str, Any] = dict(
    num_key_value_heads=4,  # as many as query heads: MLA has no KV-head grouping
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,  # transformers' name for the rotary width; _COMMON's 16 would override qk_rope_head_dim
    v_head_dim=16,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)

# architecture -> (transformers config class, settings on top of _COMMON)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {"sliding_window": None}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    # head_dim * heads != hidden_size, as in real Qwen3 checkpoints.
    "Qwen3ForCausalLM": ("Qwen3Config", {"head_dim": 32}),
    "MixtralForCausalLM": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": None},
    ),
    # Three layers: MoE, dense (mlp_only_layers), MoE.
    "Qwen2MoeForCausalLM": (
        "Qwen2MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "intermediate_size": 96,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
    ),
    # Four layers with decoder_sparse_step 2: dense, MoE, dense, MoE.
    "Qwen3MoeForCausalLM": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
        },
    ),
    # V2: q_proj without a low-rank query (V2-Lite), softmax routing, YaRN with DeepSeek's mscale_all_dim.
    "DeepseekV2ForCausalLM": (
        "DeepseekV2Config",
        {
            **_MLA,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,
            "routed_scaling_factor": 1.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        },
    ),
    # V3: low-rank query, sigmoid routing with a score-correction bias within the best 2 of 4 expert groups.
    "DeepseekV3ForCausalLM": (
        "DeepseekV3Config",
        {
            **_MLA,
            "num_hidden_layers": 3,
            "q_lora_rank": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        },
    ),
}


def scratch_dir(prefix: str) -> Path:
    """A fresh directory, removed when this process exits: for state a test process shares across modules (a
    cached model, the kernel-choice cache), where pytest's per-test ``tmp_path`` is too short-lived."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with our special tokens, trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@cache
def _tokenizer_json() -> str:
    return train_byte_level_bpe(_CORPUS, VOCAB_SIZE).to_str()


def write_tokenizer(path: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json that both `tokenizers` and `transformers.AutoTokenizer` load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _COMMON["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")


def make_tiny_model(
    arch: str,
    path: str | Path,
    *,
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    sharded: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight ``arch`` checkpoint to ``path`` and return it.

    ``overrides`` are config fields (``sliding_window=8``, ``rope_parameters={...}``).
    ``sharded`` splits the weights over several safetensors files with an index.
    The same arguments always give the same weights.
    """
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r} (known: {', '.join(ARCHITECTURES)})")
    config_name, settings = ARCHITECTURES[arch]
    kwargs = {**_COMMON, **settings, **overrides}
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    tokenizer_size = len(json.loads(_tokenizer_json())["model"]["vocab"])
    if kwargs["vocab_size"] < tokenizer_size:
        raise ValueError(f"vocab_size {kwargs['vocab_size']} does not cover the tokenizer's {tokenizer_size} tokens")
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [arch]
    torch_dtype = getattr(torch, dtype)

    model = getattr(transformers, arch)(config)
    # Our own init instead of transformers': reproducible across its versions, norm weights away from 1 and
    # routers away from 0, so that a misplaced tensor cannot go unnoticed.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: zero would test nothing
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    model.to(torch_dtype)

    path = Path(path)
    model.save_pretrained(path, max_shard_size="200KB" if sharded else "50GB")
    write_tokenizer(path)
    return path
