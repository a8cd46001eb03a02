"""A GGUF file as fw reads checkpoints: a Hugging Face–style config and (HF name, tensor) pairs.

Weights of linear layers (``*_proj.weight``) are handed over as they are stored: a uint8
``[out_features, row_bytes]`` tensor of ggml blocks, in which quant blocks run along the input
dimension, so every row is self-contained. Their ggml types are listed in the config's
``quantization_config["tensor_types"]`` (keyed by HF name), which is how each linear layer knows its
layout when it is built, before any tensor is read. Every other tensor (embeddings, LM head, norms,
biases) is dequantized to float32 here. The LM head's blocks (``output``, or the tied ``token_embd``) are
where ``quantization_config["head"]`` says in the file, for the quant method to read them again.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, LlamaFileType

from fw.sdk.errors import ModelError
from fw_quant_gguf.dequant import SUPPORTED_TYPES, dequantize

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FLOAT_FILE_DTYPES = {LlamaFileType.ALL_F32: "float32", LlamaFileType.MOSTLY_F16: "float16",
                      LlamaFileType.MOSTLY_BF16: "bfloat16"}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a tensor fw has no place for."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    return None


def is_linear_weight(name: str) -> bool:
    return name.endswith("_proj.weight")


@functools.lru_cache(maxsize=1)
def _open(path: str, stamp: tuple[int, int]) -> GGUFReader:
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelError(f"{path} is not a readable GGUF file: {exc}") from exc
    if reader.endianess != GGUFEndian.LITTLE:
        raise ModelError(f"{path} is a big-endian GGUF file; only little-endian files are supported")
    return reader


def open_reader(path: str) -> GGUFReader:
    """The parsed file. Parsing a large vocabulary takes seconds, and the engine reads the config, the
    tokenizer and the weights one after the other, so the last file stays parsed (while unchanged)
    until its weights have been read."""
    st = os.stat(path)
    return _open(os.path.realpath(path), (st.st_mtime_ns, st.st_size))


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _check_tensors(reader: GGUFReader, arch: str) -> None:
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ModelError(
                "GGUF tensor rope_freqs.weight (per-dimension RoPE factors, as llama.cpp stores Llama 3.1+ "
                "rope scaling) is not supported by fw-quant-gguf"
            )
        if hf_name(t.name) is None:
            raise ModelError(f"GGUF tensor {t.name} has no counterpart in fw's {ARCHITECTURES[arch]}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelError(
                f"GGUF tensor {t.name} has type {t.tensor_type.name}, which fw-quant-gguf cannot dequantize "
                f"(supported: {supported})"
            )


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    factor = metadata(reader, f"{arch}.rope.scaling.factor")
    if kind == "none" or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        optional = {
            "original_max_position_embeddings": metadata(reader, f"{arch}.rope.scaling.original_context_length"),
            "beta_fast": metadata(reader, f"{arch}.rope.scaling.yarn_beta_fast"),
            "beta_slow": metadata(reader, f"{arch}.rope.scaling.yarn_beta_slow"),
        }
        return {"rope_type": "yarn", "factor": factor, **{k: v for k, v in optional.items() if v is not None}}
    raise ModelError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear, yarn)")


def _torch_dtype(file_type: int | None, linear_types: set[GGMLQuantizationType]) -> str:
    """The dtype the model was converted from where the file is all floats; float32 activations for quantized
    files, as llama.cpp computes them. In bf16 the README's question on the default model (SmolLM2-135M Q4_1)
    has a first-token near-tie (0.02 nats) that the order of a kernel's float32 sums decided."""
    if file_type is not None:
        return _FLOAT_FILE_DTYPES.get(file_type, "float32")
    floats = {GGMLQuantizationType.F32: "float32", GGMLQuantizationType.F16: "float16",
              GGMLQuantizationType.BF16: "bfloat16"}
    return floats[next(iter(linear_types))] if len(linear_types) == 1 and linear_types <= floats.keys() else "float32"


def hf_config(reader: GGUFReader, path: str) -> dict[str, Any]:
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if metadata(reader, "split.count", 1) > 1:
        raise ModelError("split GGUF files are not supported; merge them into one file with llama.cpp's gguf-split")
    _check_tensors(reader, arch)

    def key(name: str, default: Any = None) -> Any:
        value = metadata(reader, f"{arch}.{name}", default)
        if value is None:
            raise ModelError(f"GGUF file lacks {arch}.{name}")
        return value

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ModelError(
            "GGUF models with partial rotary embeddings (rope.dimension_count < head_dim) are not supported"
        )
    tensors = {t.name: t for t in reader.tensors}
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelError("GGUF file has no token_embd.weight tensor")
    linear = {hf_name(t.name): t.tensor_type for t in reader.tensors if is_linear_weight(hf_name(t.name))}
    file_type = metadata(reader, "general.file_type")
    head = tensors.get("output.weight", embedding)
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch),
        "max_position_embeddings": key("context_length"),
        # ggml lists dimensions innermost first: token_embd is [hidden, vocab].
        "vocab_size": int(embedding.shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": _torch_dtype(file_type, set(linear.values())),
        "quantization_config": {
            "quant_method": "gguf",
            "file_type": next((t.name for t in LlamaFileType if t == file_type), file_type),
            "tensor_types": {name: qtype.name for name, qtype in linear.items()},
            # The head's blocks, by byte range: reading them needs no second parse of the file.
            "head": {"file": os.path.realpath(path), "offset": int(head.data_offset), "type": head.tensor_type.name,
                     "rows": int(head.shape[1]), "row_bytes": int(head.n_bytes) // int(head.shape[1])},
        },
    }


def _unpermute(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order for the llama architecture.

    Its converter reorders each head's rows from HF's rotate-half layout (first halves, then second
    halves) to GGML's interleaved pairs: rows [2, head_dim / 2] become [head_dim / 2, 2]. The order
    acts on whole rows, so it is undone the same way on packed block rows as on floats.
    """
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file, one at a time."""
    reader = open_reader(path)
    arch = metadata(reader, "general.architecture")
    permuted = {}
    if arch == "llama":
        heads = metadata(reader, "llama.attention.head_count")
        permuted = {".q_proj.": heads, ".k_proj.": metadata(reader, "llama.attention.head_count_kv", heads)}
    try:
        for t in reader.tensors:
            name = hf_name(t.name)
            rows = int(np.prod(t.shape[1:]))
            # A copy: the reader's arrays are read-only views of the file's memory map.
            raw = torch.from_numpy(np.array(t.data.view(np.uint8).reshape(rows, -1)))
            tensor = (
                raw
                if is_linear_weight(name)
                else dequantize(raw, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            )
            for part, n_head in permuted.items():
                if part in name:
                    tensor = _unpermute(tensor, n_head)
            yield name, tensor
    finally:
        # The weights are in the model now; drop the parsed file and its memory map.
        _open.cache_clear()
