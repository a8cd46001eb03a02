"""The FlashAttention plugin: light spec, honest record, clear failures without a GPU, and (on a GPU) its numerics."""

import importlib.util
import json
import subprocess
import sys
from importlib.machinery import ModuleSpec
from types import SimpleNamespace

import pytest
import torch

from conftest import run_fw
from fw.interfaces.attention import AttentionBatch, AttentionLayerSpec
from fw.interfaces.base import Requirements
from fw.interfaces.spec import BUILTIN_PRIORITY
from fw.testing.conformance import dense_attention
from fw_attention_flash_attn import backend
from fw_attention_flash_attn.spec import SPEC
from fw_attention_flashinfer.spec import SPEC as FLASHINFER

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
GPU_READY = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0) and HAS_FLASH_ATTN
GPU_SKIP_REASON = (
    "needs a CUDA GPU (compute capability >= 8.0) and flash-attn (pip install '.[flash-attn]'; "
    "scripts/gpu-check.sh does not install it: see plugins/attention/flash_attn/README.md)"
)
BLOCK_SIZES = "[256, 512, 768, 1024, 1280, 1536, 1792, 2048]"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A Llama config.json (head size 16) alone: all that `fw plugins check --model` reads."""
    from fw.testing.models import _COMMON

    path = tmp_path_factory.mktemp("plain")
    (path / "config.json").write_text(json.dumps({**_COMMON, "architectures": ["LlamaForCausalLM"]}))
    return str(path)


def test_spec_loads_without_torch_or_flash_attn():
    code = (
        "import importlib.metadata, sys\n"
        "[ep] = [e for e in importlib.metadata.entry_points(group='fw.attention') if e.name == 'flash_attn']\n"
        "spec = ep.load()\n"
        "assert spec.name == 'flash_attn' and spec.priority == 15, spec\n"
        "print(sorted(m for m in ('torch', 'flash_attn', 'flash_attn_interface') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_listed_and_shown_with_its_constraints():
    rows = json.loads(run_fw("plugins", "list", "--json").stdout)
    [row] = [r for r in rows if (r["kind"], r["name"]) == ("attention", "flash_attn")]
    assert row["distribution"] == "fw-attention-flash-attn" and row["status"] == "ok" and row["priority"] == 15
    shown = run_fw("plugins", "show", "flash_attn")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "fw-attention-flash-attn" in out and "devices: ['cuda']" in out and "priority:     15" in out
    assert f"block_sizes: {BLOCK_SIZES}" in out and "--block-size 256" in out


def test_priority_sits_between_flashinfer_and_torch():
    assert FLASHINFER.priority > SPEC.priority > BUILTIN_PRIORITY


def test_capabilities_state_what_flash_attn_accepts():
    caps = SPEC.capabilities
    assert "needs device cuda, got cpu" in caps.problems(Requirements(device="cpu"))
    assert "needs compute capability >= 8.0, got 7.5" in caps.problems(
        Requirements(device="cuda", compute_capability=(7, 5))
    )
    odd = caps.problems(
        Requirements(device="cuda", dtype="float32", head_size=100, kv_cache_dtype="fp8", block_size=16)
    )
    assert "does not support dtype float32 (supports bfloat16, float16)" in odd
    assert any(p.startswith("does not support head size 100 (supports [8, 16, 24,") for p in odd)
    assert "does not support KV-cache dtype fp8 (supports auto)" in odd
    assert f"does not support block size 16 (supports {BLOCK_SIZES})" in odd
    assert any("head size 264" in p for p in caps.problems(Requirements(device="cuda", head_size=264)))
    fits = Requirements(
        device="cuda", compute_capability=(8, 0), dtype="float16", head_size=72, block_size=512,
        attention_features=frozenset({"sliding_window", "soft_cap"}),
    )
    # On a machine without flash-attn the only problem left is the missing package.
    expected = [] if HAS_FLASH_ATTN else ["needs the Python package(s) flash_attn, which are not installed"]
    assert caps.problems(fits) == expected
    assert "does not support mla" in caps.problems(Requirements(device="cuda", attention_features=frozenset({"mla"})))


def test_check_on_cpu_lists_every_reason_and_the_alternatives(plain):
    result = run_fw("plugins", "check", "--attention", "flash_attn", "--device", "cpu", "--dtype", "float32",
                    "--model", plain)
    assert result.returncode == 1
    err = result.stderr
    assert "attention plugin 'flash_attn' needs device cuda, got cpu" in err
    assert "attention plugin 'flash_attn' does not support dtype float32 (supports bfloat16, float16)" in err
    assert "attention plugin 'flash_attn' does not support head size 16 (supports [8, 16," not in err  # 16 is fine
    assert f"attention plugin 'flash_attn' does not support block size 16 (supports {BLOCK_SIZES})" in err
    if not HAS_FLASH_ATTN:
        assert "attention plugin 'flash_attn' needs the Python package(s) flash_attn, which are not installed" in err
    assert "usable attention plugins here: torch" in err


def test_auto_never_picks_it_on_a_cpu(plain):
    result = run_fw("plugins", "check", "--device", "cpu", "--dtype", "bfloat16", "--block-size", "256",
                    "--model", plain)
    assert result.returncode == 0, result.stderr
    assert "attention: torch  (auto: " in result.stdout and "flash_attn: needs device cuda, got cpu" in result.stdout


def _check_on_a_gpu(monkeypatch, **cli):
    """validate.check as on a Hopper GPU with flash-attn and flashinfer installed (find_spec says so)."""
    from fw.config import load_config
    from fw.platform import DeviceInfo
    from fw.validate import check

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: ModuleSpec(name, None) if name in ("flash_attn", "flashinfer") else real(name, *a),
    )
    hf_config = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "num_key_value_heads": 2,
                 "hidden_size": 1024, "torch_dtype": "bfloat16"}  # head size 128
    return check(load_config(cli=cli).config, DeviceInfo("cuda", (9, 0), 1), hf_config)


def test_on_a_gpu_the_default_block_size_is_refused_with_the_reason(monkeypatch):
    result = _check_on_a_gpu(monkeypatch, attention={"name": "flash_attn"})  # fw's default block size, 16
    assert result.problems == [f"attention plugin 'flash_attn' does not support block size 16 (supports {BLOCK_SIZES})"]
    assert result.alternatives["attention"] == ["flashinfer", "torch"]
    ok = _check_on_a_gpu(monkeypatch, attention={"name": "flash_attn"}, cache={"block_size": 256})
    assert ok.ok, ok.problems


def test_on_a_gpu_auto_prefers_flashinfer_then_flash_attn_then_torch(monkeypatch):
    assert _check_on_a_gpu(monkeypatch, cache={"block_size": 256}).selected["attention"].name == "flashinfer"
    monkeypatch.setenv("FW_DISABLE_PLUGINS", "attention:flashinfer")
    assert _check_on_a_gpu(monkeypatch, cache={"block_size": 256}).selected["attention"].name == "flash_attn"
    assert _check_on_a_gpu(monkeypatch).selected["attention"].name == "torch"  # block size 16


def test_without_cuda_construction_raises_a_clear_runtime_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cls = SPEC.load()  # importing the implementation must not need flash-attn
    with pytest.raises(RuntimeError) as err:
        cls()
    assert str(err.value).startswith(backend.INSTALL_HINT)
    assert "no CUDA GPU is visible" in str(err.value)
    assert not isinstance(err.value, ImportError)


@pytest.mark.parametrize(
    ("capability", "reason"),
    [((9, 0), "the flash-attn package is not installed"), ((7, 5), "compute capability 7.5")],
)
def test_on_a_gpu_the_error_names_what_is_missing(monkeypatch, capability, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # find_spec then reports it absent
    with pytest.raises(RuntimeError, match="pip install '.\\[flash-attn\\]'") as err:
        backend.FlashAttnAttention()
    assert reason in str(err.value) and "no CUDA GPU" not in str(err.value)


# ------------------------------------------------------------------ the calls, on CPU with stand-ins


def make_batch(requests, block_size, num_blocks, device, generator):
    """requests: (context_len, new_len) pairs. Pages are drawn at random so page order matters."""
    pages = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[pages.pop() for _ in range(-(-(c + n) // block_size))] for c, n in requests]
    return AttentionBatch.build(tables, [c for c, _ in requests], [n for _, n in requests], block_size, device)


class FakeFlashAttn:
    """Stands in for flash-attn on CPU: records each call's arguments, returns zeros."""

    def __init__(self):
        self.calls = []

    def _record(self, name, q, k_cache, v_cache, **kwargs):
        self.calls.append((name, k_cache, v_cache, kwargs))
        return torch.zeros_like(q)

    def flash_attn_varlen_func(self, q, k, v, **kwargs):
        return self._record("varlen", q, k, v, **kwargs)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, **kwargs):
        return self._record("kvcache", q, k_cache, v_cache, **kwargs)


@pytest.mark.parametrize("version", [2, 3])
def test_prepare_and_forward_pass_flash_attn_the_paged_batch(monkeypatch, version):
    fake = FakeFlashAttn()
    monkeypatch.setattr(backend, "load_flash_attn", lambda: (version, fake))
    gen = torch.Generator().manual_seed(0)
    # The third request has no new tokens this step: flash-attn is not told about it.
    requests = [(0, 300), (250, 13), (5, 0), (511, 1), (256, 1)]
    batch = make_batch(requests, 256, 16, "cpu", gen)
    attn = backend.FlashAttnAttention()
    meta = attn.prepare(batch)

    assert meta.cu_seqlens_q.tolist() == [0, 300, 313, 314, 315] and meta.cu_seqlens_q.dtype == torch.int32
    seq_lens = [300, 263, 512, 257]
    assert meta.kv_lens.tolist() == ([0, 300, 563, 1075, 1332] if version == 2 else seq_lens)
    active = [0, 1, 3, 4]
    assert torch.equal(meta.block_table, batch.block_tables[active]) and meta.block_table.dtype == torch.int32
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (300, 512)

    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, sliding_window=24,
                               logits_soft_cap=30.0)
    spec = attn.kv_cache_spec(layer, 256, torch.bfloat16)
    assert spec.shape(16) == (2, 16, 256, 2, 64)  # the core's layout is flash-attn's: no override
    cache = torch.zeros(spec.shape(16), dtype=spec.dtype)
    q, k, v = (torch.randn(315, h, 64, generator=gen).bfloat16() for h in (8, 2, 2))
    out = attn.forward(layer, q, k, v, cache, meta)
    assert out.shape == q.shape
    # The new tokens' K/V land in their slots before the kernel runs.
    assert torch.equal(cache[0].view(-1, 2, 64)[batch.slot_mapping], k)
    assert torch.equal(cache[1].view(-1, 2, 64)[batch.slot_mapping], v)
    [(name, k_cache, v_cache, kwargs)] = fake.calls
    assert k_cache.data_ptr() == cache[0].data_ptr() and v_cache.data_ptr() == cache[1].data_ptr()
    assert k_cache.shape == (16, 256, 2, 64)
    common = {"softmax_scale": 0.125, "causal": True, "window_size": (23, 0), "softcap": 30.0}
    assert {key: kwargs[key] for key in common} == common
    assert kwargs["cu_seqlens_q"] is meta.cu_seqlens_q and kwargs["max_seqlen_q"] == 300
    if version == 2:
        assert name == "varlen" and kwargs["block_table"] is meta.block_table
        assert kwargs["cu_seqlens_k"] is meta.kv_lens and kwargs["max_seqlen_k"] == 512
    else:
        assert name == "kvcache" and kwargs["page_table"] is meta.block_table
        assert kwargs["cache_seqlens"] is meta.kv_lens

    full = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125)
    attn.forward(full, q, k, v, cache, meta)
    assert fake.calls[-1][3]["window_size"] == (-1, -1) and fake.calls[-1][3]["softcap"] == 0.0


def test_fa2_refuses_a_block_size_it_cannot_page_and_an_empty_step_returns_no_rows(monkeypatch):
    fake = FakeFlashAttn()
    monkeypatch.setattr(backend, "load_flash_attn", lambda: (2, fake))
    attn = backend.FlashAttnAttention()
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="divisible by 256, got block size 16; run with --block-size 256"):
        attn.prepare(make_batch([(0, 5)], 16, 4, "cpu", gen))
    meta = attn.prepare(make_batch([(5, 0)], 256, 4, "cpu", gen))
    layer = AttentionLayerSpec(num_heads=2, num_kv_heads=2, head_size=8, scale=1.0)
    cache = torch.zeros(attn.kv_cache_spec(layer, 256, torch.float16).shape(4), dtype=torch.float16)
    empty = torch.zeros(0, 2, 8, dtype=torch.float16)
    assert attn.forward(layer, empty, empty, empty, cache, meta).shape == (0, 2, 8) and not fake.calls


def test_fa3_is_used_on_hopper_only_when_it_pages(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fa2, fa3 = SimpleNamespace(name="fa2"), SimpleNamespace(flash_attn_with_kvcache=lambda q, page_table=None: q)
    modules = {backend.FA2_MODULE: fa2, backend.FA3_MODULE: fa3}
    find_spec, import_module = importlib.util.find_spec, importlib.import_module
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: ModuleSpec(n, None) if n in modules else find_spec(n, *a)
    )
    monkeypatch.setattr(importlib, "import_module", lambda n, *a: modules[n] if n in modules else import_module(n, *a))
    for capability, expected in [((9, 0), (3, fa3)), ((8, 0), (2, fa2)), ((10, 0), (2, fa2))]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_, c=capability: c)
        assert backend.load_flash_attn() == expected
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    modules[backend.FA3_MODULE] = SimpleNamespace(flash_attn_with_kvcache=lambda q, k_cache: q)  # no page_table
    assert backend.load_flash_attn() == (2, fa2)


# ------------------------------------------------------------------ GPU: against the torch backend


def _versions() -> list[int]:
    """FA2 always; FA3 too where the backend would pick it (Hopper with flash_attn_interface)."""
    if not GPU_READY:
        return [2]
    return [2, 3] if torch.cuda.get_device_capability()[0] == 9 and backend._load_fa3() is not None else [2]


@pytest.mark.cuda
@pytest.mark.skipif(not GPU_READY, reason=GPU_SKIP_REASON)
@pytest.mark.parametrize("version", _versions())
# A window and a cap small enough that an off-by-one window or an ignored cap fails the comparison (checked against
# a torch model of flash-attn's documented semantics): scores here are about N(0, 1).
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (8, None), (8, 2.0)])
def test_matches_the_torch_backend_on_gpu(monkeypatch, version, window, soft_cap):
    from fw_attention_torch.backend import TorchAttention

    if version == 2:  # FA2 even on Hopper: FA3 made unfindable
        monkeypatch.setattr(backend, "FA3_MODULE", "fw_no_such_module")
    device, dtype, block_size, num_blocks = "cuda", torch.bfloat16, 256, 32
    heads, kv_heads, head_size = 8, 2, 128  # GQA, 4 query heads per KV head
    gen = torch.Generator().manual_seed(1)
    # Prefill from scratch, prefill chunks on cached context (mid-block and block-aligned), a request with
    # nothing new this step, decodes ending mid-block, on a block boundary and just past one.
    requests = [(0, 300), (200, 90), (256, 256), (7, 500), (9, 0), (700, 1), (511, 1), (256, 1)]
    batch = make_batch(requests, block_size, num_blocks, device, gen)
    layer = AttentionLayerSpec(
        heads, kv_heads, head_size, scale=head_size**-0.5, sliding_window=window, logits_soft_cap=soft_cap
    )
    attn = backend.FlashAttnAttention()
    assert attn.version == version
    spec = attn.kv_cache_spec(layer, block_size, dtype)
    # Random values in every slot: the kernel must read only the request's own pages and positions.
    kv_cache = torch.randn(spec.shape(num_blocks), generator=gen).to(device, spec.dtype)
    tables = batch.block_tables.tolist()
    qs, ks, vs, dense = [], [], [], []
    for table, (context, new) in zip(tables, requests, strict=True):
        keys, values = (torch.randn(context + new, kv_heads, head_size, generator=gen).to(device, dtype) for _ in "kv")
        q = torch.randn(new, heads, head_size, generator=gen).to(device, dtype)
        for pos in range(context):  # the cached context, as earlier steps would have left it
            block, offset = table[pos // block_size], pos % block_size
            kv_cache[0, block, offset], kv_cache[1, block, offset] = keys[pos], values[pos]
        qs.append(q)
        ks.append(keys[context:])
        vs.append(values[context:])
        dense.append(dense_attention(q, keys, values, torch.arange(context, context + new, device=device), window,
                                     soft_cap))
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    reference_cache = kv_cache.clone()
    # The same rows without the request that has no new tokens, which the torch backend is not written for.
    kept = [i for i, (_, new) in enumerate(requests) if new]
    torch_batch = AttentionBatch.build(
        [tables[i] for i in kept], [requests[i][0] for i in kept], [requests[i][1] for i in kept], block_size, device
    )

    out = attn.forward(layer, q, k, v, kv_cache, attn.prepare(batch))
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == dtype
    # bf16 inputs; the kernel rounds probabilities to bf16 before P@V and the output to bf16 (relative step
    # 2^-8), so O(1) outputs differ by up to ~1e-2. A wrong mask, page or scale moves them by O(0.1..1).
    tol = {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), torch.cat(dense), **tol)
    torch_attn = TorchAttention()
    expected = torch_attn.forward(layer, q, k, v, reference_cache, torch_attn.prepare(torch_batch))
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    assert torch.equal(kv_cache[0].view(-1, kv_heads, head_size)[batch.slot_mapping], k)
    assert torch.equal(kv_cache[1].view(-1, kv_heads, head_size)[batch.slot_mapping], v)
