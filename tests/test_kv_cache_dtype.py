"""--kv-cache-dtype fp8 and int8: the backend's cache spec, the stored formats, end-to-end accuracy and exactness.

Measured on the tiny random bf16 Qwen2 below (48 positions, logits up to about 2.5), against the bf16 cache:
fp8 max |dlogit| 0.14, mean 0.024; int8 max 0.037, mean 0.0063. The tolerances leave about 2x margin.
"""

from __future__ import annotations

import pytest
import torch

from fw import LLM, SamplingParams
from fw.config import ConfigError
from fw.interfaces.attention import AttentionCapabilities, AttentionLayerSpec, MLADims
from fw.sdk import kv_quant
from fw.step_inputs import StepInputs
from fw.testing.models import make_tiny_model
from fw_attention_torch.backend import TorchAttention

TOLERANCE = {"fp8": (0.3, 0.05), "int8": (0.08, 0.015)}  # (max, mean) |logit - bf16 cache's logit|
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Hello world, this is", "def fibonacci(n):\n    return", "Les élèves", "x"]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("kvq") / "qwen2", dtype="bfloat16")


# ------------------------------------------------------------------ the contract


def test_spec_sizes_each_cache_dtype():
    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=128, scale=0.1)
    backend = TorchAttention()
    auto, fp8, int8 = (backend.kv_cache_spec(layer, 16, torch.bfloat16, d) for d in ("auto", "fp8", "int8"))
    assert auto.shape(10) == (2, 10, 16, 2, 128) and auto.dtype == torch.bfloat16
    assert auto.bytes_per_token == 2 * 2 * 128 * 2 and auto.bytes_per_block == 16 * auto.bytes_per_token
    assert fp8.shape(10) == (2, 10, 16, 2, 128) and fp8.dtype == torch.float8_e4m3fn
    assert fp8.bytes_per_token * 2 == auto.bytes_per_token
    # int8: each head's row carries its float32 scale.
    assert int8.shape(10) == (2, 10, 16, 2, 132) and int8.dtype == torch.int8
    assert int8.bytes_per_token == 2 * 2 * 132
    # MLA: one part, the latent and the rotary key per token, whatever the head count.
    mla = AttentionLayerSpec(16, 16, 192, 0.1, mla=MLADims(kv_lora_rank=512, qk_rope_head_dim=64,
                                                           qk_nope_head_dim=128, v_head_dim=128))
    latent = backend.kv_cache_spec(mla, 16, torch.bfloat16)
    assert latent.shape(4) == (1, 4, 16, 1, 576) and latent.bytes_per_token == 576 * 2
    with pytest.raises(ValueError, match="head size divisible by 4"):
        backend.kv_cache_spec(AttentionLayerSpec(2, 2, 6, 0.1), 16, torch.bfloat16, "int8")


def test_stored_formats_round_trip_within_their_error_bounds():
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(40, 2, 64, generator=gen)
    x[0, 0] = 0  # an all-zero row: scale 0, no NaN
    x[1, 0, :3] = torch.tensor([1000.0, -1000.0, 0.5])  # beyond fp8's range at scale 2: saturates
    slots = torch.randperm(64, generator=gen)[:40]
    for name, scale in (("fp8", 2.0), ("int8", 1.0)):
        dtype, row = kv_quant.storage(name, torch.float32, 64)
        part = torch.zeros(4, 16, 2, row, dtype=dtype)
        kv_quant.write(part, slots, x, scale)
        back = kv_quant.read(part, slots, torch.float32, scale)
        assert not back.isnan().any()
        if name == "fp8":
            assert back[1, 0, :2].tolist() == [448.0 * scale, -448.0 * scale]
            inside = (x / scale).abs() <= 448
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, or half the smallest subnormal step.
            bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10 * scale))
            assert ((back - x).abs() <= bound)[inside].all()
        else:
            step = x.abs().amax(-1, keepdim=True) / 127
            assert ((back - x).abs() <= step / 2 + 1e-6).all()
        assert back[0, 0].eq(0).all()


def test_fp8_kv_follows_from_the_cache_dtypes():
    assert "fp8_kv" in AttentionCapabilities(kv_cache_dtypes=frozenset({"auto", "fp8"})).provided_features
    assert "fp8_kv" not in AttentionCapabilities().provided_features
    # Declaring it as a feature is an error: there is one place to say it.
    assert AttentionCapabilities(features=frozenset({"fp8_kv"})).unknown_names()


# ------------------------------------------------------------------ end to end


def _runner(path, kv_cache_dtype, **settings):
    settings = {"num_kv_blocks": 8, "max_model_len": 128, **settings}
    return LLM(str(path), kv_cache_dtype=kv_cache_dtype, device="cpu", **settings).llm_engine.executor.runner


def _logits(runner, ids):
    """Every position's logits: a 32-token prefill, then one decode step per token (the native kernel on the CPU)."""
    table = [5, 2, 7]
    out = [runner.execute(StepInputs(ids[:32], [0], [32], [table[:2]], [], list(range(32)), []))]
    for p in range(32, len(ids)):
        out.append(runner.execute(StepInputs([ids[p]], [p], [1], [table], [], [0], [])))
    return torch.cat(out)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_logits_stay_close_to_the_bf16_cache(qwen2, kv_cache_dtype):
    ids = torch.randint(3, 500, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = _logits(_runner(qwen2, "auto"), ids)
    runner = _runner(qwen2, kv_cache_dtype)
    assert {c.dtype for c in runner.kv_caches} == {torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.int8}
    diff = (_logits(runner, ids) - reference).abs()
    max_tol, mean_tol = TOLERANCE[kv_cache_dtype]
    assert diff.max() <= max_tol and diff.mean() <= mean_tol, (diff.max().item(), diff.mean().item())
    assert diff.max() > 0, "the quantized cache gave the bf16 cache's logits: it was not quantized"


def test_capacity_doubles_against_bf16(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "llama", dtype="bfloat16", head_dim=128)
    tokens, used = {}, {}
    for kv_cache_dtype in ("auto", "fp8", "int8"):
        llm = LLM(str(path), kv_cache_dtype=kv_cache_dtype, kv_cache_memory="4MiB", max_model_len=128, device="cpu")
        engine = llm.llm_engine
        tokens[kv_cache_dtype] = engine.kv.pool.num_blocks * engine.config.cache.block_size
        used[kv_cache_dtype] = sum(c.nbytes for c in engine.executor.runner.kv_caches)
    assert all(b <= 4 << 20 for b in used.values())  # the allocator's tensors fit the budget they were sized for
    assert tokens["fp8"] == 2 * tokens["auto"]
    # int8 rows carry a 4-byte scale per 128 values: 256 / 132 of the bf16 capacity.
    assert tokens["int8"] >= 1.9 * tokens["auto"]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_prefix_caching_and_preemption_are_token_exact_within_the_dtype(qwen2, kv_cache_dtype):
    reference = [
        o.outputs[0].token_ids
        for o in LLM(qwen2, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, enable_prefix_caching=False)
        .generate(PROMPTS, GREEDY)
    ]
    # One at a time, then all again: the second round hits the prefix cache.
    llm = LLM(qwen2, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=160, block_size=4)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.llm_engine.kv.prefix_cache_hits > 0
    # 6 blocks of 16 tokens cannot hold four requests of ~30 tokens at once.
    engine = LLM(qwen2, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=6, max_model_len=64).llm_engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    done, preempted = {}, 0
    while engine.has_unfinished_requests():
        preempted = max([preempted] + [r.num_preemptions for r in engine.scheduler.running])
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert preempted > 0, "the cache was large enough: no preemption happened"
    assert [done[i].outputs[0].token_ids for i in ids] == reference


# ------------------------------------------------------------------ validation


def test_unknown_dtype_is_refused_naming_the_flag_and_choices(qwen2):
    with pytest.raises(ConfigError, match=r"cache.kv_cache_dtype = 'fp8_e5m2'.*'auto', 'fp8' or 'int8'"):
        LLM(qwen2, kv_cache_dtype="fp8_e5m2")


def test_backends_that_cannot_read_the_dtype_or_lack_a_model_feature_are_refused(qwen2):
    from fw.config import load_config
    from fw.platform import DeviceInfo
    from fw.validate import check

    def problems(hf_config=None, **cli):
        return check(load_config(cli=cli).config, DeviceInfo("cpu"), hf_config).problems

    assert problems(cache={"kv_cache_dtype": "int8"}) == []
    flashinfer = problems(attention={"name": "flashinfer"}, cache={"kv_cache_dtype": "int8"})
    assert "attention plugin 'flashinfer' does not support KV-cache dtype int8 (supports auto, fp8)" in flashinfer
    config = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64,
              "torch_dtype": "bfloat16"}
    assert problems(config, attention={"name": "torch"}) == []
    needy = {**config, "kv_lora_rank": 512, "attn_logit_softcapping": 50.0}
    assert problems(needy, attention={"name": "torch"}) == []  # it has both
    assert "attention plugin 'flashinfer' does not support mla" in problems(needy, attention={"name": "flashinfer"})
