"""The FlashInfer attention plugin: light spec, clear failures without a GPU, and (on a GPU) exact results."""

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fw.interfaces.attention import AttentionBatch, AttentionLayerSpec
from fw.interfaces.base import Requirements
from fw.testing.conformance import dense_attention
from fw_attention_flashinfer import backend
from fw_attention_flashinfer.spec import SPEC, SPEC_MLA

GPU_READY = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability() >= (8, 0)
    and importlib.util.find_spec("flashinfer") is not None
)


def test_spec_loads_without_torch_or_flashinfer():
    code = (
        "import importlib.metadata, sys\n"
        "[ep] = [e for e in importlib.metadata.entry_points(group='fw.attention') if e.name == 'flashinfer']\n"
        "spec = ep.load()\n"
        "assert spec.name == 'flashinfer' and spec.priority == 20, spec\n"
        "print(sorted(m for m in ('torch', 'flashinfer') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_capabilities_reject_what_flashinfer_cannot_run():
    caps = SPEC.capabilities
    assert "needs device cuda, got cpu" in caps.problems(Requirements(device="cpu"))
    old_gpu = caps.problems(Requirements(device="cuda", compute_capability=(7, 5)))
    assert "needs compute capability >= 8.0, got 7.5" in old_gpu
    odd = caps.problems(Requirements(device="cuda", dtype="float32", head_size=96, kv_cache_dtype="fp8_e4m3"))
    assert any("dtype float32" in p for p in odd)
    assert any("head size 96" in p for p in odd)
    assert any("KV-cache dtype fp8_e4m3" in p for p in odd)
    fits = Requirements(
        device="cuda", compute_capability=(9, 0), dtype="bfloat16", head_size=128, kv_cache_dtype="fp8",
        attention_features=frozenset({"sliding_window", "soft_cap"}),
    )
    # On a machine without flashinfer the only problem left is the missing package.
    expected = (
        []
        if importlib.util.find_spec("flashinfer")
        else ["needs the Python package(s) flashinfer, which are not installed"]
    )
    assert caps.problems(fits) == expected


def test_mla_record_takes_deepseek_latents_only():
    """flashinfer_mla: MLA models with DeepSeek's 512/64 latent, nothing else; the standard record no MLA."""
    caps = SPEC_MLA.capabilities
    deepseek = Requirements(
        device="cuda", compute_capability=(9, 0), dtype="bfloat16", head_size=192, architecture="DeepseekV3ForCausalLM",
        attention_features=frozenset({"mla"}), mla_dims=(512, 64),
    )
    missing = [] if importlib.util.find_spec("flashinfer") else ["needs the Python package(s) flashinfer, which are not installed"]
    assert caps.problems(deepseek) == missing
    small = caps.problems(Requirements(**{**deepseek.__dict__, "mla_dims": (64, 16)}))
    assert "does not support an MLA latent/rope width of 64/16 (supports 512/64)" in small
    llama = caps.problems(Requirements(device="cuda", head_size=128, architecture="LlamaForCausalLM"))
    assert "runs multi-head latent attention only (DeepSeek-V2/V3); the model has standard attention" in llama
    assert "does not support mla" in SPEC.capabilities.problems(deepseek)


def test_mla_plugin_is_refused_here_with_every_reason(tmp_path):
    from conftest import run_fw
    from fw.testing.models import make_tiny_model

    path = make_tiny_model("DeepseekV2ForCausalLM", tmp_path / "deepseek")
    result = run_fw("plugins", "check", "--attention", "flashinfer_mla", "--device", "cpu", "--model", str(path))
    assert result.returncode != 0
    err = result.stderr
    for reason in ("needs device cuda, got cpu", "does not support dtype float32 (supports bfloat16, float16)",
                   "does not support an MLA latent/rope width of"):
        assert "attention plugin 'flashinfer_mla' " in err and reason in err, (reason, err)
    assert "usable attention plugins here: torch" in err


def test_without_cuda_construction_raises_a_clear_runtime_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cls = SPEC.load()  # importing the implementation must not need flashinfer
    with pytest.raises(RuntimeError) as err:
        cls()
    message = str(err.value)
    assert message.startswith(backend.INSTALL_HINT)
    assert "no CUDA GPU is visible" in message
    assert not isinstance(err.value, ImportError)


@pytest.mark.parametrize(
    ("capability", "reason"),
    [((9, 0), "the flashinfer-python package is not installed"), ((7, 5), "compute capability 7.5")],
)
def test_on_a_gpu_the_error_names_what_is_missing(monkeypatch, capability, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # find_spec then reports it absent
    with pytest.raises(RuntimeError, match="pip install '.\\[flashinfer\\]'") as err:
        backend.FlashInferAttention()
    assert reason in str(err.value)
    assert "no CUDA GPU" not in str(err.value)


# ------------------------------------------------------------------ batch construction


def make_batch(requests, block_size, num_blocks, device, generator):
    """requests: (context_len, new_len) pairs. Pages are drawn at random so page order matters."""
    pages = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[pages.pop() for _ in range(-(-(c + n) // block_size))] for c, n in requests]
    return AttentionBatch.build(tables, [c for c, _ in requests], [n for _, n in requests], block_size, device)


class FakeWrapper:
    """Stands in for FlashInfer's wrapper on CPU: records plans, returns zeros."""

    instances = []

    def __init__(self, workspace, layout):
        assert layout == "NHD"
        self.plans = []
        FakeWrapper.instances.append(self)

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, paged_kv_cache):
        return torch.zeros_like(q)


def test_prepare_builds_flashinfer_page_tables_and_plans_once_per_layer_shape(monkeypatch):
    FakeWrapper.instances = []
    monkeypatch.setattr(
        backend, "load_flashinfer", lambda: SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakeWrapper)
    )
    gen = torch.Generator().manual_seed(0)
    # The third request has no new tokens this step: FlashInfer is not told about it.
    requests = [(0, 37), (20, 13), (5, 0), (31, 1), (16, 1)]
    batch = make_batch(requests, 16, 32, "cpu", gen)
    attn = backend.FlashInferAttention()
    meta = attn.prepare(batch)

    assert meta.qo_indptr.tolist() == [0, 37, 50, 51, 52]
    assert meta.kv_indptr.tolist() == [0, 3, 6, 8, 10]
    assert meta.kv_last_page_len.tolist() == [5, 1, 16, 1]
    expected_pages = [
        page
        for row, (c, n) in zip(batch.block_tables.tolist(), requests, strict=True)
        if n
        for page in row[: -(-(c + n) // 16)]
    ]
    assert meta.kv_indices.tolist() == expected_pages
    assert meta.kv_indices.dtype == torch.int32

    full = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125)
    windowed = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, sliding_window=24)
    caches = [torch.zeros(attn.kv_cache_spec(full, 16, torch.float32).shape(32)) for _ in range(3)]
    q, k, v = torch.randn(52, 8, 64), torch.randn(52, 2, 64), torch.randn(52, 2, 64)
    for _ in range(2):
        meta = attn.prepare(batch)
        for layer, cache in zip([full, windowed, full], caches, strict=True):
            attn.forward(layer, q, k, v, cache, meta)
    # Two layer shapes -> two wrappers, each planned once per step however many layers share it.
    assert len(FakeWrapper.instances) == 2
    assert [len(w.plans) for w in FakeWrapper.instances] == [2, 2]
    args, kwargs = FakeWrapper.instances[1].plans[-1]
    assert args[4:] == (8, 2, 64, 16)
    assert kwargs["causal"] and kwargs["window_left"] == 23 and kwargs["sm_scale"] == 0.125
    # The new tokens' K/V land in their slots.
    for cache in caches:
        assert torch.equal(cache[0].view(-1, 2, 64)[batch.slot_mapping], k)
        assert torch.equal(cache[1].view(-1, 2, 64)[batch.slot_mapping], v)


# ------------------------------------------------------------------ GPU: against dense attention


@pytest.mark.cuda
@pytest.mark.skipif(not GPU_READY, reason="needs a CUDA GPU and flashinfer")
@pytest.mark.parametrize(
    ("window", "soft_cap", "kv_cache_dtype"), [(None, None, "auto"), (24, 30.0, "auto"), (24, None, "fp8")]
)
def test_matches_dense_causal_attention_on_gpu(window, soft_cap, kv_cache_dtype):
    device, dtype, block_size, num_blocks = "cuda", torch.bfloat16, 16, 64
    heads, kv_heads, head_size = 8, 2, 128  # GQA, 4 query heads per KV head
    gen = torch.Generator().manual_seed(1)
    # Prefill from scratch, prefill chunks on cached context (mid-block and block-aligned), a request
    # with nothing new this step, decodes ending mid-page, on a page boundary and just past one.
    requests = [(0, 37), (20, 13), (32, 16), (7, 50), (9, 0), (45, 1), (31, 1), (16, 1)]
    batch = make_batch(requests, block_size, num_blocks, device, gen)
    layer = AttentionLayerSpec(
        heads, kv_heads, head_size, scale=head_size**-0.5, sliding_window=window, logits_soft_cap=soft_cap
    )

    attn = backend.FlashInferAttention()
    spec = attn.kv_cache_spec(layer, block_size, dtype, kv_cache_dtype)
    # Random garbage in every slot: the kernel must read only the request's own pages and positions.
    kv_cache = torch.randn(spec.shape(num_blocks), generator=gen).to(device, spec.dtype)
    tables = batch.block_tables.tolist()
    qs, ks, vs, expected = [], [], [], []
    for table, (context, new) in zip(tables, requests, strict=True):
        seq = context + new
        # Values an fp8 cache holds exactly (scale 1), so that the reference sees what the kernel reads.
        keys = torch.randn(seq, kv_heads, head_size, generator=gen).to(device, spec.dtype).to(dtype)
        values = torch.randn(seq, kv_heads, head_size, generator=gen).to(device, spec.dtype).to(dtype)
        q = torch.randn(new, heads, head_size, generator=gen).to(device, dtype)
        for pos in range(context):  # the cached context, as earlier steps would have left it
            block, offset = table[pos // block_size], pos % block_size
            kv_cache[0, block, offset], kv_cache[1, block, offset] = keys[pos], values[pos]
        qs.append(q)
        ks.append(keys[context:])
        vs.append(values[context:])
        expected.append(dense_attention(q, keys, values, torch.arange(context, context + new, device=device), window,
                                     soft_cap))

    meta = attn.prepare(batch)
    out = attn.forward(layer, torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta)
    torch.cuda.synchronize()

    assert out.shape == (batch.query_start_loc_cpu[-1], heads, head_size) and out.dtype == dtype
    # Inputs are bf16 and the reference is computed in float32 from those same values; FlashInfer
    # rounds the probabilities to bf16 before P@V and the output to bf16 (relative step 2^-8), so
    # O(1) outputs differ by up to ~1e-2. 2e-2 absolute + relative leaves margin without hiding bugs
    # (a wrong mask, page or scale moves outputs by O(0.1..1)).
    torch.testing.assert_close(out.float(), torch.cat(expected), atol=2e-2, rtol=2e-2)
    assert torch.equal(kv_cache[0].view(-1, kv_heads, head_size)[batch.slot_mapping].to(dtype), torch.cat(ks))
    assert torch.equal(kv_cache[1].view(-1, kv_heads, head_size)[batch.slot_mapping].to(dtype), torch.cat(vs))
