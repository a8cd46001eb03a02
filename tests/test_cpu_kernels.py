"""The CPU fast paths against their references: the native paged decode kernel and layer kernels, and a bf16
model end to end on the kernels chosen for this CPU (each candidate alone: tests/test_kernels.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
import torch

from fw.interfaces.attention import AttentionBatch, AttentionLayerSpec
from fw.sdk import dense, kv_quant
from fw.testing.conformance import dense_attention
from fw_attention_torch.backend import TorchAttention

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(scope="module")
def native_kernel() -> None:
    if not TorchAttention().native_decode(CPU):
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is present, yet the native paged decode kernel did not build (see the log)")
        pytest.skip("no C++ compiler: the native kernel cannot be built here (the torch path serves)")


def _decode_step(
    kernel, dtype, heads, kv_heads, head_size, window, seq_lens, block=16, kv_cache_dtype="auto", scales=(1.0, 1.0)
):
    """One decode step of ``seq_lens`` requests through ``attention.decode`` candidate ``kernel``."""
    backend = TorchAttention()
    gen = torch.Generator().manual_seed(len(seq_lens) * head_size + heads)
    num_blocks = sum(-(-n // block) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in seq_lens:  # blocks scattered over the cache, out of order
        count = -(-n // block)
        tables.append(perm[used : used + count])
        used += count
    layer = AttentionLayerSpec(heads, kv_heads, head_size, head_size**-0.5, window, k_scale=scales[0], v_scale=scales[1])
    spec = backend.kv_cache_spec(layer, block, dtype, kv_cache_dtype)
    cache = torch.empty(spec.shape(num_blocks), dtype=spec.dtype)
    every_slot = torch.arange(num_blocks * block)
    for part, scale in zip(cache, scales, strict=True):
        kv_quant.write(part, every_slot, torch.randn(len(every_slot), kv_heads, head_size, generator=gen).to(dtype), scale)
    q = torch.randn(len(seq_lens), heads, head_size, generator=gen).to(dtype)
    k = torch.randn(len(seq_lens), kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(len(seq_lens), kv_heads, head_size, generator=gen).to(dtype)
    batch = AttentionBatch.build(tables, [n - 1 for n in seq_lens], [1] * len(seq_lens), block)
    with mock.patch.dict(os.environ, {"FW_KERNELS": f"attention.decode={kernel}"}):
        out = backend.forward(layer, q, k, v, cache, backend.prepare(batch))
    return out, cache, q, tables


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(14, 2, 64), (4, 4, 128), (6, 3, 48), (8, 1, 96)])
@pytest.mark.parametrize("window", [None, 5])
def test_native_paged_decode_matches_dense_attention(native_kernel, dtype, heads, kv_heads, head_size, window):
    seq_lens = [1, 7, 16, 33, 70]
    out, cache, q, tables = _decode_step("fw", dtype, heads, kv_heads, head_size, window, seq_lens)
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([tables[i][p // 16] * 16 + p % 16 for p in range(n)])
        keys = cache[0].reshape(-1, kv_heads, head_size)[slots]  # includes the key the step just wrote
        values = cache[1].reshape(-1, kv_heads, head_size)[slots]
        expected = dense_attention(q[i : i + 1].float(), keys.float(), values.float(), torch.tensor([n - 1]), window)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out[i : i + 1].float(), expected, atol=tol, rtol=tol * 5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 5])
def test_native_paged_decode_reads_quantized_caches(native_kernel, kv_cache_dtype, dtype, window):
    """The kernel dequantizes rows as fw.sdk.kv_quant does: it matches dense attention over what the cache holds."""
    seq_lens = [1, 7, 16, 33, 70]
    scales = (0.5, 2.0) if kv_cache_dtype == "fp8" else (1.0, 1.0)  # per-layer scales: fp8 only
    args = (dtype, 6, 2, 64, window, seq_lens)
    out, cache, q, tables = _decode_step("fw", *args, kv_cache_dtype=kv_cache_dtype, scales=scales)
    reference, *_ = _decode_step("torch", *args, kv_cache_dtype=kv_cache_dtype, scales=scales)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference.float(), atol=tol, rtol=tol * 5)
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([tables[i][p // 16] * 16 + p % 16 for p in range(n)])
        keys, values = (kv_quant.read(part, slots, torch.float32, s) for part, s in zip(cache, scales, strict=True))
        expected = dense_attention(q[i : i + 1].float(), keys, values, torch.tensor([n - 1]), window)
        torch.testing.assert_close(out[i : i + 1].float(), expected, atol=tol, rtol=tol * 5)


def test_native_and_torch_paths_agree_on_a_batch(native_kernel):
    seq_lens = [3, 40, 129, 17]
    native, *_ = _decode_step("fw", torch.bfloat16, 14, 2, 64, None, seq_lens)
    reference, *_ = _decode_step("torch", torch.bfloat16, 14, 2, 64, None, seq_lens)
    torch.testing.assert_close(native.float(), reference.float(), atol=2e-2, rtol=2e-2)


def test_bf16_engine_fast_paths_match_the_reference_paths(tmp_path, monkeypatch):
    """A bf16 model end to end: packed weights + native kernels give the tokens the plain torch paths give."""
    from fw import LLM, SamplingParams
    from fw.sdk import native_ops
    from fw.testing.models import make_tiny_model

    path = make_tiny_model("Qwen2ForCausalLM", tmp_path / "qwen2", dtype="bfloat16", tie_word_embeddings=True)
    prompts = ["Hello world, this is", "def fibonacci(n):\n    return", "x"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)

    def run():
        llm = LLM(path, num_kv_blocks=64)
        model = llm.llm_engine.executor.runner.model
        chosen = {name: t.kernel.names for name, t in model.named_buffers() if hasattr(t, "kernel")}
        chosen.update({name: t.kernel.names for name, t in model.named_parameters() if hasattr(t, "kernel")})
        return chosen, llm.generate(prompts, params)

    chosen, fast = run()
    assert any(name.endswith("qkv_proj.weight") for name in chosen)  # every bf16 layer had its kernels chosen
    monkeypatch.setenv("FW_KERNELS", "torch")  # the reference candidate of every operation, attention's too
    monkeypatch.setattr(native_ops, "usable", lambda x: False)
    chosen, reference = run()
    assert {names for names in chosen.values()} == {("torch",) * len(dense.LINEAR.rows)}
    for a, b in zip(fast, reference, strict=True):
        assert_greedy_close(a.outputs[0], b.outputs[0], tolerance=0.05)


def assert_greedy_close(a, b, tolerance: float) -> None:
    """Two greedy runs of one model by different kernels: the same tokens with log-probabilities within
    ``tolerance``, up to a near-tie that their rounding may break either way (random bf16 weights make them
    common: on Zen 4 one prompt's sixth token had its top two 0.0008 apart). There each run's token is the
    other's runner-up by at most ``tolerance``, and the comparison stops, since the runs go on from different
    tokens. Needs logprobs=2."""
    for pos, (ta, tb, la, lb) in enumerate(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True)):
        assert la[ta].logprob == pytest.approx(lb[tb].logprob, abs=tolerance), pos
        if ta != tb:
            assert tb in la and ta in lb, (pos, la, lb)
            assert la[ta].logprob - la[tb].logprob <= tolerance and lb[tb].logprob - lb[ta].logprob <= tolerance, pos
            return


@pytest.fixture
def layer_kernels():
    from fw.sdk import native_ops

    if not native_ops.usable(torch.empty(1, dtype=torch.bfloat16)):
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is present, yet the native layer kernels did not build (see the log)")
        pytest.skip("no C++ compiler: the native kernels cannot be built here (the torch path serves)")
    return native_ops


def _torch_path(monkeypatch, native_ops, fn):
    with monkeypatch.context() as m:
        m.setattr(native_ops, "usable", lambda x: False)
        return fn()


@pytest.mark.parametrize("hidden", [896, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_rms_norm_matches_torch(layer_kernels, monkeypatch, hidden, with_residual):
    from fw.layers.layernorm import RMSNorm

    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6, params_dtype=torch.bfloat16)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    x = (3 * torch.randn(37, hidden, generator=gen)).bfloat16()
    residual = torch.randn(37, hidden, generator=gen).bfloat16() if with_residual else None
    fast = norm(x, residual)
    ref = _torch_path(monkeypatch, layer_kernels, lambda: norm(x, residual))
    for a, b in zip(*((fast, ref) if with_residual else ((fast,), (ref,))), strict=True):
        # Float sums in another order: at most one bf16 rounding step apart, and rarely.
        torch.testing.assert_close(a, b, atol=0, rtol=8e-3)
        assert (a != b).float().mean() < 0.01


def test_native_rotary_matches_torch_on_strided_views(layer_kernels, monkeypatch):
    from fw.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 1e6}, 4096)
    positions = torch.tensor([0, 1, 5, 900, 4000])
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=gen).bfloat16()

    def run():
        q, k, _ = qkv.clone().split([256, 128, 128], dim=-1)
        return rope(positions, q.view(5, 4, 64), k.view(5, 2, 64))

    fast, ref = run(), _torch_path(monkeypatch, layer_kernels, run)
    assert fast[0].stride(0) == 512  # rotated in place inside the fused projection's output
    for a, b in zip(fast, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_native_silu_and_mul_matches_torch(layer_kernels, monkeypatch, dtype):
    from fw.sdk.activation import silu_and_mul

    x = 4 * torch.randn(9, 2 * 300, generator=torch.Generator().manual_seed(2))  # 300: vector lanes and a tail
    x[0, :8], x[0, 300:308] = torch.tensor([-200.0, -90, -87, -20, 20, 87, 90, 200]), 1  # exp's ends
    x = x.to(dtype)
    fast, ref = silu_and_mul(x), _torch_path(monkeypatch, layer_kernels, lambda: silu_and_mul(x))
    if dtype == torch.bfloat16:
        torch.testing.assert_close(fast, ref, atol=0, rtol=8e-3)
        assert (fast != ref).float().mean() < 0.01
    else:  # the vector exp's relative error is below 2e-7
        torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("vocab", [151936, 100, 7])  # vector lanes and a tail; a tail alone
def test_native_argmax_picks_torchs_index(layer_kernels, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen)
    logits[1, vocab // 3] = logits[1, 2 * vocab // 3] = logits[1, -1] = 99  # ties: the first one wins
    logits[2] = 5.0  # all equal
    logits[3] = float("-inf")  # a fully masked row: index 0, as torch says
    logits[4, -1] = float("inf")
    logits[5, vocab // 2] = float("nan")  # torch's NaN rule for this row, the kernel's for the others
    logits[6, :] = -3e38
    logits[6, vocab - 1] = -1e38
    assert torch.equal(layer_kernels.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(layer_kernels.argmax(logits[:, : vocab // 2 + 1]), logits[:, : vocab // 2 + 1].argmax(dim=-1))
    assert layer_kernels.argmax(logits[:0]).shape == (0,)


@pytest.mark.parametrize("vocab", [151936, 3005, 7])  # blocks of 1024 and a short last one; a tail alone
def test_native_draw_takes_the_token_whose_interval_holds_the_uniform(layer_kernels, monkeypatch, vocab):
    """Temperature sampling's draw, native and in torch ops: each row's token is the one whose stretch of the
    cumulative probability (float64) holds the row's uniform, up to float32's rounding of the sums (a near-tie at a
    boundary may go either way: at 152k tokens one row in about 60 lands within it), and never a masked one."""
    from fw.sdk.sampler import draw

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(48, vocab, generator=gen) * 4
    logits[1, : vocab // 2] = float("-inf")  # a truncation's or a grammar's mask
    logits[2, :-1] = float("-inf")  # one token left: the last
    logits[3, vocab // 3] = 60  # nearly all the mass on one token
    temperature = torch.rand(48, generator=gen) + 0.2
    uniforms = torch.cat([torch.rand(1, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                          for i in range(48)])
    probs = (logits.double() / temperature.double().unsqueeze(-1)).softmax(dim=-1)
    upper = probs.cumsum(dim=-1)

    def run():  # every row seeded: its uniform is the one above
        return draw(logits, temperature, [torch.Generator().manual_seed(i) for i in range(48)])

    kernel = torch.ops.fw_layers.sample_rows(logits, temperature, uniforms)  # what draw() falls back from, if any
    for tokens in (kernel, run(), _torch_path(monkeypatch, layer_kernels, run)):
        chosen = tokens.unsqueeze(-1)
        top, p = upper.gather(-1, chosen).squeeze(-1), probs.gather(-1, chosen).squeeze(-1)
        assert (p > 0).all()
        assert ((top - p - 1e-5 <= uniforms) & (uniforms <= top + 1e-5)).all(), (tokens, uniforms)
    assert run()[1] >= vocab // 2 and run()[2] == vocab - 1 and run()[3] == vocab // 3
    flat = torch.zeros(2, vocab)
    flat[1, -1] = float("-inf")
    at_the_end = torch.ops.fw_layers.sample_rows(flat, torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert at_the_end.tolist() == [vocab - 1, vocab - 2]  # a target the sums never pass: the last token with mass
    logits[5, 0] = float("nan")  # the kernel leaves such a row to torch; the others still get tokens
    assert draw(logits, temperature, [None] * 48).shape == (48,)


def test_each_version_of_a_kernel_source_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two installs of fw on one machine (or a checkout beside an installed copy) never share a build."""
    from fw.sdk import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("// one version\n")
    b.write_text("// another version\n")
    first = native.build_directory("fw_x", a)
    assert first == native.build_directory("fw_x", a) and first.is_dir() and first.parent == tmp_path / "ext"
    assert native.build_directory("fw_x", b) != first


def test_a_build_killed_midway_does_not_block_the_next_start(tmp_path):
    """torch's lock file outlives a build that was killed: the next load must not wait on it forever."""
    from fw.sdk import native

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "FW_NATIVE": "1"}
    source = tmp_path / "k.cpp"
    source.write_text("// an empty library\n")
    script = f"from pathlib import Path; from fw.sdk import native; print(native.load('fw_test_stale', Path({str(source)!r})))"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", env["TORCH_EXTENSIONS_DIR"])
        (native.build_directory("fw_test_stale", source) / "lock").touch()  # what the killed build left
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert result.stdout.strip() == "True", result.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_native_kv_store_matches_the_torch_writes(layer_kernels, monkeypatch, dtype):
    """kv_quant.write_kv's native copy (the model dtype's cache) stores what the torch path stores, from k and v
    views into a fused q/k/v output; other tokens' slots stay as they were; a slot outside the cache is refused."""
    from fw.interfaces.attention import AttentionLayerSpec
    from fw.sdk import kv_quant

    layer = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, layer_idx=0)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    _, k, v = qkv.split([64, 32, 32], dim=-1)
    k, v = k.view(5, 2, 16), v.view(5, 2, 16)
    slots = torch.tensor([3, 17, 18, 40, 0])
    start = torch.randn(2, 6, 8, 2, 16, generator=gen).to(dtype)
    fast, ref = start.clone(), start.clone()
    calls = []
    with monkeypatch.context() as m:
        store = torch.ops.fw_layers.store_kv
        m.setattr(torch.ops.fw_layers, "store_kv", lambda *args: calls.append(1) or store(*args))
        parts = kv_quant.write_kv(fast, slots, k, v, layer)
    assert calls  # the native path ran
    with monkeypatch.context() as m:
        m.setattr(layer_kernels, "usable", lambda x: False)
        kv_quant.write_kv(ref, slots, k, v, layer)
    assert torch.equal(fast, ref)
    assert torch.equal(fast[0].view(-1, 2, 16)[slots], k) and torch.equal(fast[1].view(-1, 2, 16)[slots], v)
    assert parts[0].data_ptr() == fast.data_ptr()
    assert torch.equal(fast.view(2, -1, 2, 16)[:, 1], start.view(2, -1, 2, 16)[:, 1])  # an untouched slot
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.fw_layers.store_kv(fast, torch.tensor([48]), k[:1], v[:1])


@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "window", "cap"),
                         [(14, 2, 64, None, None), (16, 1, 64, 30, None), (4, 4, 32, None, 30.0), (12, 2, 128, 9, None),
                          (6, 3, 48, None, None), (4, 2, 20, 3, None)])
@pytest.mark.parametrize(("context", "chunk"), [(0, 128), (37, 100), (5, 9), (70, 1)])
@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [(torch.bfloat16, "auto"), (torch.float32, "auto"),
                                                       (torch.float16, "int8"), (torch.bfloat16, "fp8")])
def test_native_prefill_is_a_decode_of_each_token(native_kernel, heads, kv_heads, head_size, window, cap, context,
                                                  chunk, dtype, kv_cache_dtype):
    """``paged_prefill`` attends each token of a chunk as ``paged_decode`` attends a request of that token's length,
    bit for bit (its sums add the same terms in the same order; the positions past a token's own weigh 0): fresh
    prompts and chunks over cached context, ragged lengths, windows, a soft cap, head sizes with and without the
    bf16 fast path (48: the generic one in vectors; 20: partly scalar), each query dtype and KV-cache format."""
    from fw_attention_torch import backend as torch_attention

    layer = AttentionLayerSpec(heads, kv_heads, head_size, head_size**-0.5, window, logits_soft_cap=cap,
                               k_scale=0.5 if kv_cache_dtype == "fp8" else 1.0)
    backend = TorchAttention()
    spec = backend.kv_cache_spec(layer, 16, dtype, kv_cache_dtype)
    q, cache, metadata = backend._sample(layer, dtype, torch.empty(spec.shape(1), dtype=spec.dtype), [context],
                                         [chunk], prefill=chunk > 1)
    out = torch_attention._native_prefill(layer, q, cache, torch_attention._Chunk(
        torch.empty(0), None, metadata.batch.block_tables[0], context))
    rows = torch_attention._native_decode(layer, q, cache, torch_attention._decode_rows(metadata.batch))
    assert torch.equal(out, rows)


@pytest.fixture(scope="module")
def greedy_head():
    from fw.sdk import native

    if not native.load("fw_dense", dense._SOURCE):
        pytest.fail("the native dense kernels did not build (see the log)") if shutil.which("c++") else pytest.skip(
            "no C++ compiler: the native kernels cannot be built here")
    if not torch.ops.fw_dense.greedy_supported():
        pytest.skip("this CPU has no AVX-512 BF16 and VNNI: dense.argmax computes every logit (its 'logits' candidate)")
    return torch.ops.fw_dense.greedy_head


def _close_columns(gen, vocab, width, copies):
    """A head whose columns come in near-copies: each of `copies` columns is another's plus a change below its int8
    step, so that their int8 estimates tie and their bounds overlap, and only the exact sums tell them apart; and
    some exact copies, whose logits tie bit for bit (the lowest column must win)."""
    w = 0.05 * torch.randn(vocab, width, generator=gen)
    src = torch.randint(0, vocab, (copies,), generator=gen)
    dst = torch.randperm(vocab, generator=gen)[:copies]
    step = w.abs().amax(dim=1, keepdim=True) / 127
    w[dst] = w[src] + step[src] * 0.3 * torch.randn(copies, width, generator=gen).clamp(-1, 1)
    w[dst[: copies // 4]] = w[src[: copies // 4]]
    return w.bfloat16(), src


# greedy_head's int8 sums (VNNI or AMX-INT8 tiles) and the logits kernel whose sums it matches (fw's or fw-amx's).
_GREEDY_PATHS = [(False, False), (True, False), (False, True), (True, True)]


def _greedy_path(greedy_head, width, amx_bounds, amx_exact):
    """The logits kernel greedy_head must match on this path, or a skip naming what this machine lacks."""
    if (amx_bounds or amx_exact) and not torch.ops.fw_dense.greedy_amx_supported():
        pytest.skip("no AMX-INT8 and AMX-BF16 tiles here: dense.argmax's fw-amx-int8 and fw-amx logits cannot run")
    if (amx_bounds and width % 64) or (amx_exact and width % dense.AMX_DEPTH):
        pytest.skip(f"AMX tiles take 64 (int8) and 32 (bf16) input features at a time, not {width}")
    return torch.ops.fw_dense.amx_linear if amx_exact else torch.ops.fw_dense.linear


@pytest.mark.parametrize(("amx_bounds", "amx_exact"), _GREEDY_PATHS)
@pytest.mark.parametrize(("vocab", "width", "rows"), [(4096, 896, 1), (4096, 896, 3), (4096, 896, 8), (4096, 896, 17),
                                                       (4096, 896, 33), (160, 68, 5), (160, 64, 40), (48, 4, 2)])
def test_greedy_head_is_the_argmax_of_the_logits_kernels_logits(greedy_head, vocab, width, rows, amx_bounds,
                                                                  amx_exact):
    """dense.argmax's fw-int8 and fw-amx-int8: int8 bounds, then the exact logits of the blocks they leave, the token
    of the full logits of the kernel that computes them (fw's or fw-amx's, which add a column's products in other
    orders) bit for bit, where near-copies of columns make the bounds leave many and exact copies tie."""
    logits_kernel = _greedy_path(greedy_head, width, amx_bounds, amx_exact)
    gen = torch.Generator().manual_seed(vocab + width + rows)
    w, src = _close_columns(gen, vocab, width, copies=vocab // 4)
    tiles = dense._fw_tiles(w)
    q8, terms, sums = torch.ops.fw_dense.greedy_pack(w)
    for trial in range(6):
        x = torch.randn(rows, width, generator=gen)
        if trial % 2:  # rows aimed at the near-copied columns: their logits lead, and the copies with them
            x = w[src[torch.randint(0, len(src), (rows,), generator=gen)]].float() * 40 + 0.1 * x
        x = x.bfloat16()
        logits = logits_kernel(x, tiles, None, True)
        for limit in (vocab, vocab - 5):  # the head's padding rows are no tokens
            tokens = greedy_head(x, tiles, q8, terms, sums, limit, amx_bounds, amx_exact)
            assert torch.equal(tokens, logits[:, :limit].argmax(dim=-1)), trial


@pytest.mark.parametrize("amx_bounds", [False, True])
def test_greedy_head_keeps_a_column_its_int8_estimate_puts_a_bound_width_behind(greedy_head, amx_bounds):
    """The bound taken as tight as it gets: x all ones, column A's rounding errors all +3/8 of its int8 step (its
    estimate that much low) and B's all -3/8 (that much high), so that B's estimate leads A's by 47 steps while A's
    logit leads B's by a quarter step. A bound 3% narrower than the kernel's would leave A out."""
    step = 2.0**-10  # every value below is a bf16 and the int8 steps come out exact
    w = torch.zeros(16, 64)
    w[2, 0] = w[5, 0] = 127 * step  # the largest weight of each column sets its scale to `step`
    w[5, 1:] = 10.375 * step  # int8 10, +3/8
    w[2, 1:48] = 10.625 * step  # int8 11, -3/8
    w[2, 48:] = 9.625 * step  # int8 10, -3/8: B's int8 sum 47 above A's, its logit 1/4 step below
    w = w.bfloat16()
    tiles = dense._fw_tiles(w)
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    logits = _greedy_path(greedy_head, 64, amx_bounds, False)(x, tiles, None, True)
    assert logits[0].argmax() == 5 and logits[0, 5] - logits[0, 2] == pytest.approx(step / 4)
    assert greedy_head(x, tiles, *torch.ops.fw_dense.greedy_pack(w), 16, amx_bounds).tolist() == [5]


@pytest.mark.parametrize(("amx_bounds", "amx_exact"), _GREEDY_PATHS)
def test_greedy_head_rows_that_bound_nothing(greedy_head, amx_bounds, amx_exact):
    """Rows of zeros (every logit ties at 0: the first column), and rows with a NaN or an infinity, which no bound
    holds for: every column is computed, and the token is torch's argmax of the logits (a NaN first)."""
    logits_kernel = _greedy_path(greedy_head, 64, amx_bounds, amx_exact)
    gen = torch.Generator().manual_seed(0)
    w = (0.05 * torch.randn(256, 64, generator=gen)).bfloat16()
    tiles = dense._fw_tiles(w)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    x[0] = 0
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3, 0] = 3e38  # finite, beyond what a bound is taken for
    expected = logits_kernel(x, tiles, None, True).argmax(dim=-1)
    tokens = greedy_head(x, tiles, *torch.ops.fw_dense.greedy_pack(w), 256, amx_bounds, amx_exact)
    assert torch.equal(tokens, expected)
    assert expected[0] == 0


def test_a_head_that_is_not_finite_has_no_int8_copy():
    from fw.sdk import native

    if not native.load("fw_dense", dense._SOURCE):
        pytest.skip("no native kernels here")
    w = torch.zeros(32, 8, dtype=torch.bfloat16)
    assert len(torch.ops.fw_dense.greedy_pack(w)) == 3
    w[5, 2] = float("inf")
    assert torch.ops.fw_dense.greedy_pack(w) == []
    w = torch.full((32, 8), 1e38, dtype=torch.bfloat16)  # finite, but a column's 1-norm is not, in float32
    assert torch.ops.fw_dense.greedy_pack(w) == []


def test_greedy_decoding_skips_the_logits_and_gives_their_tokens(greedy_head, tmp_path, monkeypatch):
    """A bf16 model's greedy requests take dense.argmax's fw-int8 (no logits, no sampler) and the tokens the logits
    and the sampler give; a request that asks for logprobs in the batch brings the logits back for every row."""
    from fw import LLM, SamplingParams
    from fw.testing.models import make_tiny_model

    path = make_tiny_model("Qwen2ForCausalLM", tmp_path / "qwen2", dtype="bfloat16", tie_word_embeddings=True)
    prompts = ["Hello world, this is", "def fibonacci(n):\n    return", "x"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(kernel):
        monkeypatch.setenv("FW_KERNELS", f"dense.argmax={kernel},dense.logits=fw")
        llm = LLM(path, num_kv_blocks=64)
        head = llm.llm_engine.executor.runner.model.lm_head
        calls = []
        sample = llm.llm_engine.sampler.sample
        monkeypatch.setattr(llm.llm_engine.sampler, "sample", lambda *a: calls.append(1) or sample(*a))
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        return head, calls, outputs, llm

    head, calls, int8, llm = run("fw-int8")
    assert head.argmax is not None and set(head.argmax.names) == {"fw-int8"}
    assert not calls  # every step's tokens came from the head
    mixed = llm.generate(prompts, [greedy, greedy, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                   logprobs=1)])
    assert calls and [o.outputs[0].token_ids for o in mixed] == int8
    head, calls, logits, _ = run("logits")
    assert head.argmax is None and calls  # the int8 copy is not kept where nothing chose it
    assert int8 == logits


def test_greedy_head_defers_to_the_logits_where_they_take_another_kernel(greedy_head, monkeypatch):
    """The int8 candidates' exact columns are fw's or fw-amx's sums: for a row class whose logits another kernel
    computes (fw-plain here), dense.argmax takes those logits' argmax, so a greedy row's token does not depend on
    whether its step skipped the logits."""
    w = (0.1 * torch.randn(96, 64, generator=torch.Generator().manual_seed(0))).bfloat16()
    usable = {c.name: c for c in dense.LOGITS.supported(dense._key(w))}
    names = tuple("fw-plain" if rows == 1 else "fw" for rows in dense.LOGITS.rows)
    selection = dense.LOGITS._build(dense._key(w), w, names, usable)
    tiles = selection.state("fw")
    tiles.kernel = selection
    head = dense.ArgmaxHead(tiles, tiles, torch.ops.fw_dense.greedy_pack(w), 96)
    deferred = []
    of_logits = dense._argmax_of_logits
    monkeypatch.setattr(dense, "_argmax_of_logits", lambda h, x: deferred.append(len(x)) or of_logits(h, x))
    for rows in (1, 8):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(dense.ARGMAX.candidates["fw-int8"].run(head, x), of_logits(head, x))
    assert deferred == [1]
