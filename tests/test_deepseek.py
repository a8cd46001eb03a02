"""DeepSeek-V2/V3: multi-head latent attention (MLA) and DeepSeek's expert routing, against transformers.

test_models.py checks both tiny checkpoints of ``fw.testing.models`` like every architecture (float32 and
bf16 logits); here: other settings of each (low-rank query or not, grouped routing, YaRN, rope layout), greedy
tokens through ``fw.LLM``, the torch backend's two MLA paths against each other, chunked prefill over the
prefix cache, and the refusal of backends without "mla".
"""

from __future__ import annotations

import random

import pytest
import torch
from test_models import (
    assert_matches_reference,
    assert_tp2_matches_single_rank,
    load_ours,
    load_reference,
    prompts,
)

from conftest import fw_greedy, hf_greedy, run_fw
from fw.interfaces.attention import AttentionBackend, AttentionBatch, AttentionLayerSpec, MLADims
from fw_attention_torch.backend import TorchAttention

ARCHS = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]


# The settings the tiny checkpoints of fw.testing.models do not have (test_models.py checks those).
VARIANTS = {
    # V2 with the low-rank query of the full V2, and its group-limited routing (best expert per group).
    "DeepseekV2ForCausalLM": {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
    # V3 with neox rotary layout, and YaRN whose mscale differs from mscale_all_dim (cos/sin scaled too).
    "DeepseekV3ForCausalLM": {
        "rope_interleave": False,
        "rope_parameters": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0,
            "mscale": 1.0, "mscale_all_dim": 0.8,
        },
    },
}


@pytest.mark.parametrize("arch", ARCHS)
def test_other_settings_match_transformers_fp32(checkpoint, arch):
    assert_matches_reference(checkpoint(arch, **VARIANTS[arch]))


# The triton backend runs MLA in its kernel's absorbed form for prefill too (Triton's interpreter here).
@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(checkpoint, arch, attention):
    path = checkpoint(arch)
    assert fw_greedy(path, attention=attention) == hf_greedy(load_reference(path), path)


def test_v3_router_bias_steers_the_choice(checkpoint):
    """The tiny V3's e_score_correction_bias is random, so the parity checks cover it; it must also matter."""
    model = load_ours(checkpoint("DeepseekV3ForCausalLM"))
    moe = model.model.layers[1].mlp
    logits = torch.randn(64, moe.gate.weight.shape[0], generator=torch.Generator().manual_seed(0))
    _, chosen = moe.route(logits)
    moe.gate.e_score_correction_bias.zero_()
    _, unbiased = moe.route(logits)
    assert not torch.equal(chosen.sort(-1).values, unbiased.sort(-1).values)


def test_multi_token_prediction_layers_are_not_loaded(checkpoint):
    """V3 checkpoints carry MTP layers after the decoder (model.layers.61 of 61): fw serves only the decoder."""
    from fw.model_loader import load_model
    from fw.models.base import HFConfig, ModelContext
    from fw.models.deepseek import DeepseekV3ForCausalLM
    from fw.sdk.checkpoint import iter_safetensors
    from fw_quant_none.method import Unquantized

    path = checkpoint("DeepseekV3ForCausalLM")
    config = HFConfig.from_file(path / "config.json")
    extra = [("model.layers.3.eh_proj.weight", torch.zeros(64, 128)), ("model.layers.3.enorm.weight", torch.ones(64))]
    ctx = ModelContext(dtype=torch.float32, quant=Unquantized(), attention=TorchAttention())
    load_model(DeepseekV3ForCausalLM, config, ctx, [*iter_safetensors(path), *extra])


# --- the torch backend's MLA: prefill (expanded K/V) and decode (absorbed) on the same tokens -----------------

MLA = MLADims(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
HEADS, BLOCK = 4, 8
LENGTHS = {0: 21, 1: 13}
SCHEDULES = {
    "one_shot": [dict(LENGTHS)],
    # Every token a decode step (query_len 1): the absorbed path only.
    "decode": [{0: 1, 1: 1}] * 13 + [{0: 1}] * 8,
    # Request 0 in prefill chunks over its cached tokens while request 1 prefills, then decodes beside it.
    "mixed": [{0: 7, 1: 5}, {0: 7, 1: 1}, {0: 7, 1: 1}] + [{1: 1}] * 6,
}


def run_mla(schedule, kv_cache_dtype="auto", backend=None, block=BLOCK):
    """Feed the same per-token inputs by ``schedule`` to ``backend`` (the torch one by default); return each
    request's outputs, one row per token."""
    gen = torch.Generator().manual_seed(0)
    tokens = {
        rid: [torch.randn(n, *shape, generator=gen) for shape in ((HEADS, 16), (HEADS, 8), (32,), (8,))]
        for rid, n in LENGTHS.items()
    }
    w_uk = 0.2 * torch.randn(HEADS, 16, 32, generator=gen)
    w_uv = 0.2 * torch.randn(HEADS, 32, 16, generator=gen)
    spec = AttentionLayerSpec(num_heads=HEADS, num_kv_heads=1, head_size=24, scale=24**-0.5, mla=MLA)
    backend = backend or TorchAttention()
    cache_spec = backend.kv_cache_spec(spec, block, torch.float32, kv_cache_dtype)
    # NaN where never written (auto), so that reading an unwritten slot shows.
    cache = torch.full(cache_spec.shape(16), float("nan")).to(cache_spec.dtype)
    free = list(range(1, 16))
    random.Random(0).shuffle(free)
    blocks, done, outs = {0: [], 1: []}, {0: 0, 1: 0}, {0: [], 1: []}
    for step in schedule:
        for rid, n in step.items():
            while len(blocks[rid]) * block < done[rid] + n:
                blocks[rid].append(free.pop())
        batch = AttentionBatch.build(
            [blocks[r] for r in step], [done[r] for r in step], list(step.values()), block
        )
        inputs = [torch.cat([tokens[r][i][done[r] : done[r] + n] for r, n in step.items()]) for i in range(4)]
        out = backend.forward_mla(spec, *inputs, w_uk, w_uv, cache, backend.prepare(batch))
        starts = batch.query_start_loc_cpu
        for i, (rid, n) in enumerate(step.items()):
            outs[rid].append(out[starts[i] : starts[i + 1]])
            done[rid] += n
    return {rid: torch.cat(rows) for rid, rows in outs.items()}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
@pytest.mark.parametrize("schedule", ["decode", "mixed"])
def test_mla_prefill_and_absorbed_decode_agree(schedule, kv_cache_dtype):
    expected = run_mla(SCHEDULES["one_shot"], kv_cache_dtype)
    got = run_mla(SCHEDULES[schedule], kv_cache_dtype)
    for rid in LENGTHS:
        assert torch.allclose(got[rid], expected[rid], rtol=1e-5, atol=1e-5), (got[rid] - expected[rid]).abs().max()


# Relative error of the outputs (norm of the difference over the norm) from a quantized latent cache: e4m3 keeps
# 3 mantissa bits (observed 3%), int8 rows 127 steps of their absmax (observed 0.7%).
QUANTIZED_CACHE_TOL = {"fp8": 0.06, "int8": 0.015}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_mla_quantized_cache_stays_close(kv_cache_dtype):
    exact, quantized = run_mla(SCHEDULES["mixed"]), run_mla(SCHEDULES["mixed"], kv_cache_dtype)
    for rid in LENGTHS:
        assert (quantized[rid] - exact[rid]).norm() / exact[rid].norm() < QUANTIZED_CACHE_TOL[kv_cache_dtype]


def test_latent_cache_holds_one_row_per_token_and_sizes_the_capacity(checkpoint):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values, and no K/V per head: the
    blocks a memory budget buys, and so the engine's token capacity, follow from that row."""
    import json

    from fw import LLM

    path = checkpoint("DeepseekV2ForCausalLM")
    config = json.loads((path / "config.json").read_text())
    row = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    budget, block = 2**20, 16
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=budget, block_size=block, max_model_len=128)
    try:
        engine = llm.llm_engine
        caches = engine.executor.runner.kv_caches
        blocks = budget // (config["num_hidden_layers"] * block * row * 4)  # float32 values
        assert [tuple(c.shape) for c in caches] == [(1, blocks, block, 1, row)] * config["num_hidden_layers"]
        assert engine.kv.pool.num_blocks == blocks
    finally:
        llm.shutdown()


def test_chunked_prefill_and_prefix_cache_stay_token_exact(checkpoint):
    """Prompts that share 40 tokens: the second reuses the first's cached blocks and prefills its tail in
    chunks of at most 16 tokens on top of them; both continue exactly as transformers does."""
    from fw import LLM, SamplingParams

    path = checkpoint("DeepseekV3ForCausalLM")
    shared = prompts((40,), seed=1)[0]
    token_prompts = [shared + [7, 8, 9, 10, 11], shared + [12, 13]]
    hf = load_reference(path)
    expected = [
        hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in token_prompts
    ]
    llm = LLM(
        str(path), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128, block_size=8,
        max_num_batched_tokens=16, enable_prefix_caching=True,
    )
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in token_prompts]
    finally:
        llm.shutdown()
    assert outs[1].num_cached_tokens == 40
    assert [o.outputs[0].token_ids for o in outs] == expected


# --- backends without MLA ---------------------------------------------------------------------------------


def test_backend_without_mla_is_refused(checkpoint):
    from fw.config import load_config
    from fw.model_registry import read_hf_config
    from fw.platform import DeviceInfo
    from fw.validate import check

    hf_config = read_hf_config(str(checkpoint("DeepseekV3ForCausalLM")))
    # The architecture declares "mla" itself: refused even where config.json has no kv_lora_rank to go by.
    del hf_config["kv_lora_rank"]
    config = load_config(cli={"attention": {"name": "flashinfer"}, "model": {"dtype": "bfloat16"}}).config
    result = check(config, DeviceInfo("cuda", (9, 0)), hf_config)
    assert "attention plugin 'flashinfer' does not support mla" in result.problems
    assert result.alternatives["attention"] == ["torch"]

    class NoMLA(AttentionBackend):
        def forward(self, layer, q, k, v, kv_cache, metadata):
            return q

    with pytest.raises(NotImplementedError, match="NoMLA does not implement MLA"):
        NoMLA().forward_mla(*[None] * 9)


def test_fw_plugins_check_names_the_missing_feature(checkpoint):
    path = checkpoint("DeepseekV2ForCausalLM")
    result = run_fw("plugins", "check", "--attention", "flashinfer", "--device", "cpu", "--model", str(path))
    assert result.returncode == 1
    assert "attention plugin 'flashinfer' does not support mla" in result.stderr
    assert "usable attention plugins here: torch" in result.stderr


@pytest.mark.slow
def test_tensor_parallel_2_matches_single_rank(checkpoint, tmp_path):
    """Heads (q, kv_b_proj, o_proj) and expert widths split over two gloo ranks; the latent is replicated."""
    assert_tp2_matches_single_rank([checkpoint(arch) for arch in ARCHS], tmp_path)


def test_v3_block_fp8_checkpoint_loads_and_matches_its_dequantized_weights(checkpoint, tmp_path):
    """DeepSeek-V3's own format: ``quant_method: fp8`` with ``weight_block_size`` and ``weight_scale_inv`` per
    linear layer and expert, the router left in float."""
    from conftest import assert_experts_match, load_layers
    from fw import model_registry
    from fw_quant_fp8 import testing as fp8
    from fw_quant_fp8.method import Fp8Method
    from fw_quant_fp8.spec import Fp8Options
    from fw_quant_none.method import Unquantized

    path = fp8.write_checkpoint(checkpoint("DeepseekV3ForCausalLM"), tmp_path / "fp8", kind="block", block=(32, 32))
    quant_config = model_registry.read_hf_config(str(path))["quantization_config"]
    # Weight-only, so that the layers compute with exactly the dequantized weights.
    model = load_layers(path, Fp8Method(Fp8Options(activations="none"), quant_config))
    reference = load_layers(path, Unquantized(), fp8.dequantized(path))
    layer = model.get_submodule("model.layers.0.self_attn.kv_a_proj_with_mqa")
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape[1] > 1  # blocks, not rows
    for block in assert_experts_match(model, reference):
        assert block.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert [len(t) for t in fw_greedy(path)] == [16, 16]
